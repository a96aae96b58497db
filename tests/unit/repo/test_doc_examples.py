"""The README's `tpuboot status` example is what the command prints on the host it describes (a
v5p bound to vfio-pci in IOMMU group 4, vfio-pci built into Ubuntu's kernel): the page cannot
drift from the output."""

from __future__ import annotations

from pathlib import Path

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import add_tpu
from tpuboot import cli

README = Path(__file__).resolve().parents[3] / "README.md"


def example(text: str, command: str) -> str:
    """The lines after ``    $ command`` up to the next prompt or blank line, unindented."""
    lines = text.splitlines()
    start = lines.index(f"    $ {command}") + 1
    shown = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("    $ "):
            break
        shown.append(line.removeprefix("    "))
    return "\n".join(shown) + "\n"


def test_the_readmes_status_example_is_the_output(tmp_path: Path, capsys) -> None:
    kernel = FakeKernel(tmp_path, vfio="builtin")
    add_tpu(kernel, "0000:00:04.0", driver="vfio-pci", group="4")
    kernel.p("/dev/vfio/4").chmod(0o666)
    assert cli.main(["--root", str(tmp_path), "status"]) == cli.EXIT_OK
    assert capsys.readouterr().out == example(README.read_text(), "tpuboot status")
