"""Every `--json` holds to doc/operation.md's table (`--json`: one shape per command): each command
run on a test tree (a bound TPU, a boot budget, the metadata emulator on loopback) prints a list of
objects or one object, as the table says, with exactly the table's top-level keys."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import add_tpu
from tpuboot import bootbudget, cli
from tpuboot.notices import noticefile
from tpuboot.notices.parse import PREEMPTED, Notice

TABLE = Path(__file__).resolve().parents[3] / "doc/operation.md"
ROW = re.compile(r"^\| `([a-z-]+(?: --[a-z]+)*)` \| ([^|]+) \| ([^|]+) \|$")
MACHINE = "projects/1/machineTypes/ct5p-hightpu-4t"


def documented() -> dict[str, tuple[str, list[str]]]:
    """command (with its options) -> ("list" or "object", its keys), from the table's rows."""
    text = TABLE.read_text()
    section = text[text.index("### `--json`: one shape per command") :]
    section = section[: section.index("\n#")]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            shape = "object" if match[2].strip() == "one object" else "list"
            assert shape == "object" or match[2].startswith("a list, "), line
            rows[match[1]] = (shape, re.findall(r"`([a-z_]+)`", match[3]))
    return rows


DOCUMENTED = documented()


def test_the_table_names_every_command_with_json() -> None:
    """The commands whose parser takes --json, and `status --boot --json`."""
    (commands,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    with_json = {name for name, sub in commands.choices.items() if "--json" in sub.format_help()}
    assert {command.split(" --")[0] for command in DOCUMENTED} == with_json
    assert "status --boot --json" in DOCUMENTED


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory):
    """A bound TPU, a READY boot budget and a configuration aiming at the emulator on loopback."""
    top = tmp_path_factory.mktemp("root")
    kernel = FakeKernel(top)
    add_tpu(kernel, driver="vfio-pci")
    budget = bootbudget.Budget(kernel.root, clock=lambda: 1.0)
    budget.mark(bootbudget.READY)
    budget.save()
    noticefile.save(kernel.root, [Notice(PREEMPTED, True, "TRUE")])  # what wait-maintenance prints
    with MetadataEmulator({"tpu-env": SAMPLE_TPU_ENV}, instance={"machine-type": MACHINE}) as emulator:
        (top / "tpuboot.yaml").write_text(f"metadata: {{host: '{emulator.host}'}}\n")
        yield top


@pytest.mark.parametrize("command", list(DOCUMENTED))
def test_each_json_is_the_shape_the_table_says(command: str, tree: Path, capsys) -> None:
    shape, keys = DOCUMENTED[command]
    extra = ["--timeout", "5"] if command.startswith("slice") else []
    code = cli.main(["--root", str(tree), "--config", "/tpuboot.yaml", *command.split(), *extra])
    assert code in (cli.EXIT_OK, cli.EXIT_FAILED)
    printed = json.loads(capsys.readouterr().out)
    if shape == "object":
        assert isinstance(printed, dict) and list(printed) == keys
    else:
        assert isinstance(printed, list) and printed, printed
        assert all(isinstance(item, dict) and list(item) == keys for item in printed), printed[0]
