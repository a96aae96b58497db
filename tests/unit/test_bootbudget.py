"""The boot budget's record: phases timed from the process's start as /proc says it, the first
end of each phase counting, binds closed at READY, and the line, fields and file it gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tpuboot import bootbudget
from tpuboot.bootbudget import BIND, COLDPLUG, METADATA, READY, VBAR, BootBudget, Budget, process_start
from tpuboot.component import Status
from tpuboot.containers.agents import VBAR as VBAR_LABEL
from tpuboot.containers.supervisor import RUNNING, STARTING
from tpuboot.derived import VbarMark
from tpuboot.paths import Root

TICK = os.sysconf("SC_CLK_TCK")


def tree(tmp_path: Path, start_ticks: int | None = None, command: str = "python3") -> Root:
    if start_ticks is not None:
        proc = tmp_path / "proc/self"
        proc.mkdir(parents=True)
        rest = ["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 30  # starttime is field 22
        (proc / "stat").write_text(f"4242 ({command}) " + " ".join(rest) + "\n")
    return Root(tmp_path)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_start_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    root = tree(tmp_path, 500 * TICK, command="tpu boot) (x")
    assert process_start(root) == 500.0


@pytest.mark.parametrize("ticks", ["²", "١٢", "+1", "1_0", "0x10", "", "9" * (1 << 20), "-5", "\udcff"])
def test_a_start_time_that_is_not_the_kernels_digits_is_unknown(tmp_path: Path, ticks: str) -> None:
    proc = tmp_path / "proc/self"
    proc.mkdir(parents=True)
    rest = ["S"] + ["0"] * 18 + [ticks or "''"] + ["0"] * 30
    text = "4242 (python3) " + " ".join(rest) + "\n"
    (proc / "stat").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert process_start(Root(tmp_path)) is None


def test_phases_count_from_the_process_start(tmp_path: Path) -> None:
    clock = Clock(503.0)
    budget = Budget(tree(tmp_path, 500 * TICK), clock)
    assert budget.started_after_boot == 500.0
    budget.mark(COLDPLUG, "9 PCI functions")
    clock.now = 504.5
    budget.mark(READY)
    assert [(p.label, p.seconds) for p in budget.phases()] == [
        ("coldplug-enumerated 9 PCI functions", 3.0),
        ("ready", 4.5),
    ]
    assert budget.summary().endswith("(started 500.00 s after the kernel)")


def test_without_proc_the_budget_counts_from_its_own_birth(tmp_path: Path) -> None:
    clock = Clock(10.0)
    budget = Budget(tree(tmp_path), clock)
    clock.now = 11.25
    budget.mark(READY)
    assert budget.started_after_boot is None and budget.phases()[0].seconds == 1.25
    assert "after the kernel" not in budget.summary()


def test_a_start_after_now_is_another_clock_and_not_trusted(tmp_path: Path) -> None:
    budget = Budget(tree(tmp_path, 900 * TICK), Clock(100.0))
    assert budget.started_after_boot is None and budget.origin == 100.0


def test_the_first_end_of_a_phase_counts_and_binds_close_at_ready(tmp_path: Path) -> None:
    clock = Clock(0.0)
    budget = Budget(tree(tmp_path), clock)
    for now, name, detail in [
        (1, METADATA, ""),
        (2, BIND, "0000:00:04.0"),
        (3, METADATA, ""),
        (4, READY, ""),
    ]:
        clock.now = now
        budget.mark(name, detail)
    clock.now = 9
    budget.mark(BIND, "0000:00:05.0")  # hot-added after READY
    budget.mark(VBAR)  # after READY, and still part of the boot
    assert [p.label for p in budget.phases()] == [
        "metadata-answered",
        "bind 0000:00:04.0",
        "ready",
        "vbar-running",
    ]
    assert budget.phases()[0].seconds == 1


def test_journal_fields_and_summary(tmp_path: Path) -> None:
    clock = Clock(0.0)
    budget = Budget(tree(tmp_path), clock)
    for now, address in [(1.0, "0000:00:05.0"), (0.5, "0000:00:04.0")]:
        budget.mark(BIND, address, at=now)
    clock.now = 2.0
    budget.mark(READY)
    assert budget.journal_fields() == {
        "TPUBOOT_BOOT_BINDS": "0000:00:04.0=0.500 0000:00:05.0=1.000",
        "TPUBOOT_BOOT_READY": "2.000",
    }
    assert budget.summary() == "boot budget: 2 binds 0.50-1.00 s, ready 2.00 s"


def test_the_record_round_trips_and_a_bad_one_is_none(tmp_path: Path) -> None:
    root = tree(tmp_path)
    assert bootbudget.load(root) is None
    budget = Budget(root, Clock(0.0))
    budget.mark(READY)
    budget.save()
    record = bootbudget.load(root)
    assert record is not None and record["phases"] == [{"phase": "ready", "detail": "", "seconds": 0.0}]


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2",
        "[1, 2]",
        "{}",
        '{"phases": {}}',
        '{"phases": [1]}',
        '{"phases": [{"phase": "ready", "seconds": "2"}]}',
        '{"phases": [{"phase": "ready", "seconds": NaN}]}',
        '{"phases": [{"phase": "ready", "seconds": 1e400}]}',
        '{"phases": [{"phase": "ready", "seconds": ' + "9" * 400 + "}]}",
        '{"phases": [{"phase": "ready", "seconds": true}]}',
        '{"phases": [{"phase": "ready", "seconds": -1}]}',
        '{"phases": [{"phase": "\\u001b[2J", "seconds": 1}]}',
        '{"phases": [{"phase": "bind", "detail": 5, "seconds": 1}]}',
        '{"phases": [], "started_after_boot_seconds": "x"}',
        "[" * 100_000,
        b'{"phases": [{"phase": "ready", "detail": "\xff", "seconds": 1}]}',
    ],
)
def test_a_damaged_record_is_one_line_that_says_so(tmp_path: Path, capsys, text) -> None:
    """`status --boot` on a record of the wrong shape, types, huge numbers, NaN, nested deep, not
    UTF-8: one line that names the file and the fix, exit 1, no traceback (also with --json)."""
    from tpuboot import cli

    root = tree(tmp_path)
    path = root.path(bootbudget.BUDGET_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for json_flag in ([], ["--json"]):
        assert cli.main(["--root", str(tmp_path), "status", "--boot", *json_flag]) == cli.EXIT_FAILED
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith(f"tpuboot: {bootbudget.BUDGET_PATH} is damaged (")
        assert err.endswith("the daemon writes it again at READY (systemctl restart tpuboot)\n")


def test_marks_outside_a_daemon_do_nothing() -> None:
    bootbudget._current = None
    bootbudget.mark(READY)  # `tpuboot env` writes tpu-env through the same code
    assert bootbudget.current() is None


class Agents:
    """The containers as vBar's mark reads them: each agent's Status."""

    def __init__(self) -> None:
        self.vbar = Status(STARTING, "starting")

    def statuses(self) -> dict[str, Status]:
        return {VBAR_LABEL: self.vbar}


def test_ready_and_vbars_first_run_are_marked_once_each_and_published(tmp_path: Path, caplog) -> None:
    """READY's mark is the boot part's, at READY; vBar's comes from an after-boot part once the
    containers (which start after READY) say vBar runs. Each is published: metrics and the file."""
    clock = Clock(0.0)
    shown: list[list[str]] = []
    saved: list[object] = []
    part = BootBudget(
        Budget(tree(tmp_path), clock), saved.append, lambda ps: shown.append([p.name for p in ps])
    )
    agents = Agents()
    mark = VbarMark(part, agents)  # type: ignore[arg-type]
    caplog.set_level("INFO", logger="tpuboot")
    part.observe(False)
    clock.now = 2.0
    part.observe(True)
    part.observe(True)
    mark.observe(True)  # vBar still starting
    assert shown == [["ready"]] and len(saved) == 1
    assert [r.getMessage() for r in caplog.records] == ["boot budget: ready 2.00 s"]
    clock.now = 5.0
    agents.vbar = Status(RUNNING, "running")
    mark.observe(True)
    mark.observe(True)
    assert shown == [["ready"], ["ready", "vbar-running"]] and len(saved) == 2
    assert [p.seconds for p in part.budget.phases()] == [2.0, 5.0]
