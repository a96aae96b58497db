"""The harness's reading of a guest console for a stalled vCPU (harness.vm.machine.guest_stalled):
the kernel's own lines, as 6.1 and 6.12 print them, and lines that only look alike."""

from __future__ import annotations

import pytest

from harness.vm.machine import guest_stalled

STALLS = [
    "[  232.695394] watchdog: BUG: soft lockup - CPU#0 stuck for 208s! [python3:158]",
    "[   61.100001] rcu: INFO: rcu_preempt self-detected stall on CPU",
    "[   61.100001] rcu: INFO: rcu_sched detected stalls on CPUs/tasks:",
    "[   61.100001] rcu: INFO: rcu_preempt detected expedited stalls on CPUs/tasks: { 1-... } 21003 jiffies",
]
NOT_STALLS = [
    "[    0.041000] rcu: Hierarchical RCU implementation.",
    "[    0.210000] NMI watchdog: Perf NMI watchdog permanently disabled",
    "[    1.000000] watchdog: Delayed init of the lockup detector failed: -19",
    "tpuboot[412]: soft lockup of the metrics port refused",
]


@pytest.mark.parametrize("line", STALLS)
def test_a_stall_line_is_found_and_quoted_whole(line: str) -> None:
    console = f"[    1.0] Booting\n{line}\n[FAILED] Failed to start tpuboot.service\n"
    assert guest_stalled(console) == line


@pytest.mark.parametrize("line", NOT_STALLS)
def test_lines_that_only_look_alike_are_no_stall(line: str) -> None:
    assert guest_stalled(f"{line}\n") is None


def test_a_stall_on_the_last_line_without_a_newline() -> None:
    assert guest_stalled(STALLS[0]) == STALLS[0]
