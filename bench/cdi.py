"""Family cdi: a hot-added chip until usable by tester, and until its node is in the CDI spec on
disk (guest clock, one waiter for both); the spec is the daemon's, so only tpuboot is measured."""

from __future__ import annotations

import threading
import time

from bench.guest import GUEST_HELPER, HOTPLUG_PORT, BenchError, ConsoleTail, guest_json
from bench.hotplug import hotplug_address
from bench.table import Report, Row, spread
from harness.vm.guestcmd import Result
from harness.vm.machine import VM
from tpuboot.containers.cdi import SPEC_PATH as CDI_SPEC
from tpuboot.containers.cdi import name_of
from tpuboot.devices.chips import base_address

CDI_LAG_GOAL_S = 0.050  # the CDI spec lands within 50 ms of the chip becoming usable


def cdi_rep(vm: VM, console: ConsoleTail, address: str, serial: int) -> tuple[float, float]:
    """One add -> (usable, in the spec) on the guest clock from the add -> remove cycle."""
    tag = f"@CD{serial:03d}"
    box: dict[str, Result] = {}
    argv = ["python3", GUEST_HELPER, "cdi", address, "--spec", CDI_SPEC, "--tag", tag]

    def wait() -> None:
        box["r"] = vm.run(argv, timeout=40)

    waiter = threading.Thread(target=wait, name=f"cdi-waiter-{serial}", daemon=True)
    waiter.start()
    try:
        ready_at = console.wait_for(f"{tag}r", timeout=30)
        t0 = time.monotonic()
        vm.device_add("edu", id=f"cd{serial}", bus=HOTPLUG_PORT)
    finally:
        waiter.join(timeout=60)
    marks = guest_json(box["r"], "cdi waiter") if "r" in box else {}
    vm.device_del(f"cd{serial}")
    vm.wait_until(f"! grep -q '{name_of(base_address(address))}' {CDI_SPEC}", timeout=20)
    if marks.get("usable") is None or marks.get("spec") is None:
        raise BenchError(f"cdi: hot-added {address} not usable and in the spec: {marks}")
    guest_add = marks["start"] + (t0 - ready_at)
    return marks["usable"] - guest_add, marks["spec"] - guest_add


def run_family(vm: VM, reps: int, report: Report) -> None:
    """Hot add -> usable by tester, and -> its node in the CDI spec (guest clock, one waiter for
    both); the spec is the daemon's, so tpuboot alone is measured (no baseline writes one)."""
    address = hotplug_address(vm)
    console = ConsoleTail(vm.console_path)
    try:
        reps_s = [cdi_rep(vm, console, address, serial) for serial in range(reps + 1)][1:]  # 1 warm-up
    finally:
        console.close()
    usable, spec = [u for u, _ in reps_s], [s for _, s in reps_s]
    lag = [s - u for u, s in reps_s]
    report.add("cdi", Row(f"cdi: device_add -> usable by tester (n={reps})", spread(usable), "n/a"))
    report.add("cdi", Row("cdi: device_add -> node in the CDI spec on disk", spread(spec), "n/a"))
    verdict = "n/a" if not lag else ("PASS" if max(lag) <= CDI_LAG_GOAL_S else "FAIL")
    goal = f"worst <= {CDI_LAG_GOAL_S * 1000:.0f} ms"
    report.add("cdi", Row("cdi: usable -> in the spec", spread(lag), "n/a", None, goal, verdict))
    report.note("cdi", "guest clock; both polled every 2 ms; a negative lag: the spec came first")
    report.raw["cdi"] = {"address": address, "usable_s": usable, "spec_s": spec}
