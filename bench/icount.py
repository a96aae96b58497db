"""A guest whose clock counts instructions: QEMU's ``-icount shift=0`` (1 ns of guest time per
instruction executed), one vCPU, single-threaded TCG.

TCG makes code that runs once (an interpreter's start: thousands of fresh blocks to translate)
far slower than code that loops (a shell's builtins), so the bench's wall-clock ratios of a
Python command to a shell script overstate what real hardware shows. The host cannot count
instructions (no PMU under the host's own hypervisor: ``perf stat -e instructions`` says "not
supported"), and Debian's QEMU ships no TCG plugins. With icount the guest's CLOCK_MONOTONIC
advances by the instructions the whole system executes (one vCPU: everything that runs while
the command runs is counted, as it would be timed on one core), plus real time while the vCPU
is idle (``sleep=on``, the default: waits for disk I/O), so the same guest-side measurements
read as instruction counts where the work is CPU-bound, which it is with a warm page cache.
What remains unlike real hardware is instructions per cycle (CPython's interpreter loop and a
shell's differ), not translation cost.
"""

from __future__ import annotations

from harness.vm.machine import VM


class IcountVM(VM):
    """The bench's VM with an instruction-counting clock (TCG only; KVM has no icount)."""

    def qemu_argv(self) -> list[str]:
        argv = super().qemu_argv()
        if self.accel != "tcg":
            raise RuntimeError(f"icount needs TCG, this guest runs under {self.accel}")
        at = argv.index("tcg,thread=multi")
        argv[at] = "tcg,thread=single"
        return [*argv, "-icount", "shift=0"]
