"""The harness's reading of a guest console for a stalled vCPU (harness.vm.machine.guest_stalled):
the kernel's own lines, as 6.1 and 6.12 print them, and lines that only look alike."""

from __future__ import annotations

import pytest

from harness.vm.machine import early_panic, guest_stalled

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


# CI's Debian 13 guest, 2026-12-02: an int3 oops in the kernel's own start, before /init ran.
EARLY = """Booting from ROM..[    2.037607] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI
[    2.038064] CPU: 0 UID: 0 PID: 0 Comm: swapper/0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[    2.041929] Oops: int3: 0000 [#2] PREEMPT SMP NOPTI
[    2.042159] CPU: 1 UID: 0 PID: 1 Comm: swapper/0 Tainted: G      D            6.12.117+deb13-amd64 #1
[    2.042306] Kernel panic - not syncing: Fatal exception in interrupt
"""


def test_a_panic_before_init_ran_is_the_emulators() -> None:
    assert early_panic(EARLY) == "Kernel panic - not syncing: Fatal exception in interrupt"


def test_a_panic_once_a_program_of_the_guest_ran_is_not() -> None:
    later = EARLY.replace("PID: 1 Comm: swapper/0", "PID: 412 Comm: tpuboot")
    assert early_panic(later) is None


def test_an_oops_without_a_panic_or_a_panic_naming_no_task_is_not() -> None:
    assert early_panic(EARLY.replace("Kernel panic - not syncing", "Kernel said")) is None
    assert early_panic("[    9.1] Kernel panic - not syncing: VFS: Unable to mount root fs\n") is None
