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

from bench.coldplug import coldplug_reps
from bench.guest import PEER, SIDES, BenchError, driverctl_armed, edu_addresses, helper, stop_tpuboot
from bench.table import Report, insn, insn_row, median_ratio
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


def run_family(vm: VM, runs: int, report: Report) -> None:
    """The cli and coldplug families' commands again in a guest whose clock counts instructions
    (bench/icount.py)."""
    addresses = edu_addresses(vm)
    address = addresses[0]
    results, _ = coldplug_reps(vm, addresses, runs)
    for key, metric in (
        ("all_usable_s", f"icount (M instructions): coldplug 8, start -> all 8 usable (n={runs})"),
        ("command_s", "  start -> READY (8 bound, tpu-env) | trigger --settle + env script"),
    ):
        values = {s: [r[key] for r in results if r["side"] == s and r[key] is not None] for s in SIDES}
        row = insn_row(metric, values["tpuboot"], values["baseline"])
        if key == "all_usable_s":
            row.against(PEER, insn(values[PEER]), median_ratio(values["tpuboot"], values[PEER]), 1.0)
        report.add("icount", row)
    stop_tpuboot(vm)
    driverctl_armed(vm, False)
    data = helper(vm, "cli", address, "--runs", str(runs), timeout=1800)
    if data["errors"]:
        raise BenchError(f"icount: CLI runs failed: {data['errors']}")
    usable = helper(vm, "usable", address, "--runs", str(runs), timeout=1800)
    if usable["errors"]:
        raise BenchError(f"icount: bind-until-usable runs failed: {usable['errors']}")
    times = data["times"]
    for metric, ours, base in (
        (
            f"icount (M instructions): CLI bind, tpuboot | bind_to_vfio_pci.sh (n={runs})",
            "tpuboot",
            "baseline",
        ),
        ("  the same with the shipped config", "tpuboot, shipped config", "baseline"),
        ("  python3 -c pass | bash -c true", "python3 -c pass", "bash -c true"),
        ("  python3 -c 'import tpuboot.cli' | bash -c true", "import tpuboot.cli", "bash -c true"),
    ):
        report.add("icount", insn_row(metric, times[ours], times[base]))
    for key, metric in (
        ("usable_s", "  CLI bind -> usable by tester: tpuboot | script | driverctl"),
        ("command_s", "  the same, until the command returns"),
    ):
        values = {side: [r[key] for r in usable["runs"][side]] for side in SIDES}
        row = insn_row(metric, values["tpuboot"], values["baseline"])
        report.add(
            "icount",
            row.against(PEER, insn(values[PEER]), median_ratio(values["tpuboot"], values[PEER]), 1.0),
        )
    report.note(
        "icount",
        "one vCPU, single-threaded TCG, -icount shift=0: the guest clock advances 1 ns per instruction "
        "the whole guest executes, plus real time while it idles (sleep=on); host perf has no PMU here",
    )
    report.raw["icount"] = {"address": address, **data, "usable": usable, "coldplug": results}
