"""Family hotplug: QMP ``device_add edu`` into root port ``hp0`` until usable.

``--reps`` per side, in ABAB halves, each half after one discarded warm-up. Host clock, from just
before the QMP command to the moment the host sees a marker that the guest waiter writes on the
console (ttyS0: a file QEMU appends to as the guest prints; polled every 1 ms) right after its
first successful read. The waiter is started (as tester) before device_add and polls every 5 ms,
cheaply until the node is open to all. Error, the same for both sides: up to 5 ms of guest poll,
1 ms of host poll, plus the console's latency, which every rep checks by comparing the host-clock
and the guest-clock spans between the waiter's two markers ("marker skew"). Guest-clock phases
(in sysfs, bound, node exists, node 0666) show where the time goes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from bench.guest import (
    GUEST_HELPER,
    HOTPLUG_PORT,
    PEER,
    SIDES,
    BenchError,
    ConsoleTail,
    check_usable,
    driverctl_armed,
    edu_addresses,
    guest_json,
    use_side,
)
from bench.table import Report, Row, median, median_ratio, ratio_row, spread
from harness.vm.guestcmd import Result
from harness.vm.machine import VM

log = logging.getLogger("bench.bind")

PHASES = {"appear": "in sysfs", "bound": "vfio-pci bound", "node": "node exists", "mode": "node 0666"}


@dataclass
class HotplugRep:
    side: str
    warmup: bool
    total_s: float  # host clock: just before device_add -> usable marker seen
    qmp_s: float  # the device_add QMP round trip (bounds when, within it, the device appeared)
    skew_ms: float  # host span minus guest span between the waiter's markers: the method's error
    phases_s: dict[str, float | None]  # guest clock, from device_add mapped by the first marker


def hotplug_rep(
    vm: VM, console: ConsoleTail, address: str, side: str, serial: int, warmup: bool
) -> HotplugRep:
    """One add -> usable -> remove cycle, the waiter started and ready before the add."""
    tag = f"@BB{serial:03d}"
    box: dict[str, Result] = {}

    def wait() -> None:
        box["r"] = vm.run(["python3", GUEST_HELPER, "hotplug", address, "--tag", tag], timeout=40)

    waiter = threading.Thread(target=wait, name=f"waiter-{serial}", daemon=True)
    waiter.start()
    device_id = f"bb{serial}"
    try:
        ready_at = console.wait_for(f"{tag}r", timeout=30)
        t0 = time.monotonic()
        vm.device_add("edu", id=device_id, bus=HOTPLUG_PORT)
        qmp_s = time.monotonic() - t0
        usable_at = console.wait_for(f"{tag}u", timeout=30)
    finally:
        waiter.join(timeout=60)
    marks = guest_json(box["r"], "hotplug waiter") if "r" in box else {}
    vm.device_del(device_id)
    if side == PEER:  # its unit stays active (RemainAfterExit) and would not run on the next add
        driverctl_armed(vm, True, [address])
    if marks.get("usable") is None:
        raise BenchError(f"{side}: hot-added {address} never became usable: {marks}")
    guest_add = marks["start"] + (t0 - ready_at)
    phases = {k: None if v is None else v - guest_add for k, v in marks.items() if k != "start"}
    skew = (usable_at - ready_at) - (marks["usable"] - marks["start"])
    return HotplugRep(side, warmup, usable_at - t0, qmp_s, skew * 1000, phases)


def hotplug_address(vm: VM) -> str:
    """Where an edu device lands in ``hp0`` (the same on every add): add one, look, remove it.

    tpuboot binds it meanwhile, so vfio-pci is loaded before any timed add, for both sides.
    """
    before = set(edu_addresses(vm))
    vm.device_add("edu", id="bbprobe", bus=HOTPLUG_PORT)
    deadline = time.monotonic() + 30
    while not (new := set(edu_addresses(vm)) - before):
        if time.monotonic() > deadline:
            raise BenchError("the hot-added edu device did not show up in the guest")
    (address,) = new
    wait_node_open(vm, address)
    check_usable(vm, address)
    vm.device_del("bbprobe")
    return address


def wait_node_open(vm: VM, address: str, timeout: float = 20.0) -> None:
    node = f"/dev/vfio/$(basename $(readlink /sys/bus/pci/devices/{address}/iommu_group))"
    vm.wait_until(f'[ "$(stat -c %a {node} 2>/dev/null)" = 666 ]', timeout=timeout)


def run_family(vm: VM, reps: int, report: Report) -> None:
    address = hotplug_address(vm)
    console = ConsoleTail(vm.console_path)
    results: list[HotplugRep] = []
    stops: list[float] = []
    half = max(reps // 2, 1)
    serial = 0
    try:
        for side in (*SIDES, *SIDES):
            stopped = use_side(vm, side, [address])
            if side != "tpuboot":
                stops.append(stopped)
            for i in range(half + 1):
                serial += 1
                rep = hotplug_rep(vm, console, address, side, serial, warmup=i == 0)
                results.append(rep)
                log.info("hotplug %s%s: %.3f s", side, " (warm-up)" if rep.warmup else "", rep.total_s)
    finally:
        console.close()

    def per_side(phase: str | None) -> list[list[float]]:
        """Timed reps' values per side: the host-clock total, or a guest-clock phase."""
        timed = [r for r in results if not r.warmup]
        return [
            [
                v
                for r in timed
                if r.side == s and (v := r.phases_s.get(phase) if phase else r.total_s) is not None
            ]
            for s in SIDES
        ]

    def row(metric: str, phase: str | None, goal: float | None = None, aim: str = "") -> Row:
        tp, base, peer = per_side(phase)
        shown = spread(peer)
        return ratio_row(metric, tp, base, goal, aim).against(
            PEER, shown, median_ratio(tp, peer), goal and 1.0
        )

    metric = f"hotplug: device_add -> usable by tester (host clock, n={half * 2})"
    report.add("hotplug", row(metric, None, 1.0, ", aim 0.5x"))
    for phase, name in PHASES.items():
        report.add("hotplug", row(f"  device_add -> {name} (guest clock)", phase))
    skews = [abs(r.skew_ms) for r in results]
    report.note(
        "hotplug",
        f"marker skew |host span - guest span| median {median(skews):.1f} ms, max {max(skews):.1f} ms; "
        f"device_add QMP round trip median {median([r.qmp_s for r in results]) * 1000:.1f} ms; "
        f"`systemctl stop tpuboot` took {', '.join(f'{s:.2f}' for s in stops)} s; driverctl: "
        "its saved override applied by its udev rule and driverctl@.service, the node opened by a "
        'udev MODE="0666" rule',
    )
    report.raw["hotplug"] = {"address": address, "reps": [asdict(r) for r in results], "stop_s": stops}
