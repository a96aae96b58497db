"""tpuboot's benchmarks in one run, each against its baseline and its peer measured in the same run.

Binding and start-up against the documented udev rule + shell handler and cloud-init script, on
a real kernel; idle cost against a sleeping python3; the metadata client against the documented
fetch made to retry. The peers, the tools people already run for these jobs (``bench/peers.py``,
Debian's packages in the same guests, never active beside tpuboot): ``driverctl`` for binding
(by hand, its saved overrides at boot and on hot add), ``google-guest-agent`` for the idle
footprint. Usage, from the repository root (root is needed for the image build and QEMU)::

    sudo .venv/bin/python -m bench.run [--json FILE] [--markdown FILE]
                                       [--only hotplug,cdi,coldplug,cli,icount,idle,fleet,holders]
                                       [--reps 6] [--coldplug-reps 5] [--cli-runs 10]
                                       [--icount-runs 5]

About 7 minutes with warm caches (.cache/vm), more while other QEMU guests share the host: the
.deb and one guest image are built, then one QEMU guest (TCG, 2 vCPUs) per scenario family, and
the fleet simulation runs on the host after the last guest is gone.
Each family measures tpuboot and the baseline in the same guest, never both active at once: for
the baseline, ``systemctl stop tpuboot``, the rule copied to /etc/udev/rules.d and ``udevadm
control --reload``; for tpuboot, the rule removed and reloaded, tpuboot started. The baseline
is ``bench/baseline/``: the documented ``99-tpu-vfiopci.rules`` with the stand-in ids (edu
1234:11e8, virtio-rng 1af4:1005) and ``bind_to_vfio_pci.sh`` (modprobe vfio-pci,
driver_override, unbind, drivers_probe, chmod 0666 /dev/vfio/<group>, allow_unsafe_interrupts).

driverctl's side: its udev rules unmasked, the overrides saved in /etc/driverctl.d as
``driverctl set-override`` saves them, ``udevadm control --reload``; plus what driverctl does not
do and a user must add for an unprivileged user: a udev rule ``SUBSYSTEM=="vfio", MODE="0666"``
(the mode tpuboot and the documented script set) and ``allow_unsafe_interrupts`` as a module
option. Its ``driverctl@.service`` units are stopped between reps (a bench drop-in allows it):
a unit still active from the last add would not run again.

"Usable" always means what a TPU user needs: as the unprivileged ``tester``, the VFIO type1 walk
of ``harness/vm/guest/vfio_read.py`` (container, group, IOMMU, device fd) reads the edu device's
BAR0 identification register, 0x010000ed. The guest side is ``bench/bind_guest.py``.

Families and timing methods:

1. hotplug -- QMP ``device_add edu`` into root port ``hp0`` until usable; ``--reps`` per side,
   in ABAB halves, each half after one discarded warm-up. Host clock, from just before the QMP
   command to the moment the host sees a marker that the guest waiter writes on the console
   (ttyS0: a file QEMU appends to as the guest prints; polled every 1 ms) right after its first
   successful read. The waiter is started (as tester) before device_add and polls every 5 ms,
   cheaply until the node is open to all. Error, the same for both sides: up to 5 ms of guest
   poll, 1 ms of host poll, plus the console's latency, which every rep checks by comparing the
   host-clock and the guest-clock spans between the waiter's two markers ("marker skew").
   Guest-clock phases (in sysfs, bound, node exists, node 0666) show where the time goes.
2. coldplug -- 8 edu devices present at boot, unbound (no driver, no override) before each
   rep. Guest clock, from the start of ``systemctl start tpuboot`` (returns at READY: Type=notify,
   i.e. the 8 bound and tpu-env written) or of the baseline's boot job (``udevadm trigger --settle
   --action=add --subsystem-match=pci``, what it does at boot, returning once those events,
   handler included, are done; then the documented cloud-init ``configure-env-vars.sh``: curl
   tpu-env from the metadata server, YAML to ``KEY="value"`` lines) until all 8 are usable
   (10 ms poll, as tester), and until the command returns ("start -> READY"). The daemon is
   stopped before the clock starts. tpuboot's journal splits its start: exec -> first "bound"
   line -> READY. After the timed reps, one ``tpuboot run`` started by hand (no sandbox, no
   systemd) stamps its own imports and functions (``bind_guest.py profile``): where the start-up
   time goes.
3. cli -- ``tpuboot bind DBDF`` against ``bind_to_vfio_pci.sh DBDF`` on one edu device, the
   daemon stopped, the device unbound before each run, each command first in turn; guest
   monotonic clock around the command. tpuboot runs twice over: with the bench's config (a device
   rule for edu, which PyYAML reads) and with the shipped,
   all-comments one (``--force``, as edu is then no TPU), which is what an image without extra
   device rules runs. Then the
   interpreter's start-up and each import step of ``tpuboot run`` are timed (and their RSS
   taken) in a fresh python3, best of 2, and 3 ``tpuboot bind`` runs stamp their own imports
   and functions: where the time goes. Then bind -> usable (``bind_guest.py usable``): ``tpuboot
   bind``, the script and ``driverctl set-override DBDF vfio-pci`` run as root while a forked
   poller, already ``tester``, polls every 5 ms; until usable, and until the command returns.
3b. icount -- the cli family's commands again in a guest whose clock counts instructions
   (``bench/icount.py``: one vCPU, ``-icount shift=0``): what TCG's translation cost does not skew.
4. idle -- the daemon's VmRSS, CPU ticks (utime+stime) and per-thread wakeups (voluntary
   context switches; schedstat timeslices) over the 60 s that a ``python3 -c 'import time;
   time.sleep(60)'`` process sleeps; that process's VmRSS is the RSS baseline. Threads are named
   by the system call they block in (Python 3.11 gives its threads no kernel name). This window
   runs first, while the next family's guest boots: wakeups and RSS do not depend on host load.
   Then tpuboot is stopped and google-guest-agent started alone, against the metadata emulator on
   169.254.169.254:80 (an address on lo); after 30 s of its start-up work, the same window on its
   process. Each emulator counts the requests of the window (``GET /_emulator/stats``).

6. holders -- on the host, no guest: ``bench/holders.py`` makes 2,000 processes of 50 open files
   each, three holding a node, and times ``tpuboot who`` against ``fuser -v`` and ``lsof`` on it
   in turn (wall and CPU time, medians); goal: at most fuser's time.

5. fleet -- on the host, no guest: ``bench/fleet.py``'s 64 simulated hosts boot at once against
   one metadata server emulator failing 20% of requests (then again after a 5 s total outage),
   tpuboot's real MetadataClient + EnvSync against the documented fetch retried every 1 s.

Benchmarks print figures; they are not assertions and pytest does not collect them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import peers
from bench.icount import IcountVM
from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.accel import select_accel
from harness.vm.artifacts import (
    GUEST_LIBEXEC,
    Artifacts,
    InstallHook,
    build_image,
    ensure_artifacts,
    in_tree,
    remove_tree,
)
from harness.vm.guestcmd import Result
from harness.vm.hostenv import cache_dir
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    MDS_PORT,
    VFIO_READ,
    build_deb,
    guest_config,
    package_install_hook,
    vbar_install_hook,
)
from tpuboot.containers.cdi import SPEC_PATH as CDI_SPEC
from tpuboot.containers.cdi import name_of
from tpuboot.devices.chips import base_address

log = logging.getLogger("bench.bind")

HERE = Path(__file__).resolve().parent
BENCH_LIBEXEC = "/usr/local/libexec/tpuboot-bench"
GUEST_HELPER = f"{BENCH_LIBEXEC}/bind_guest.py"
RULE_NAME = "99-tpu-vfiopci.rules"
STAGED_RULE = f"{BENCH_LIBEXEC}/{RULE_NAME}"
ACTIVE_RULE = f"/etc/udev/rules.d/{RULE_NAME}"
HANDLER = "/lib/udev/bind_to_vfio_pci.sh"
HOTPLUG_PORT = "hp0"
FAMILIES = ("hotplug", "cdi", "coldplug", "cli", "icount", "idle", "fleet", "holders")
VM_FAMILIES = ("hotplug", "cdi", "coldplug", "cli", "icount", "idle")
CDI_LAG_GOAL_S = 0.050  # the CDI spec lands within 50 ms of the chip becoming usable
SIDES = ("tpuboot", "baseline", "driverctl")  # the binding families' sides, one armed at a time
PEER = "driverctl"
RSS_GOAL_MIB = 20.0
LONG_POLL_S = 60.0  # metadata.watch_timeout: the watch's long-poll returns this often when idle


class BenchError(RuntimeError):
    """A scenario could not be measured: the guest did not behave as the bench expects."""


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    """One line of the final table; ``ratio`` is tpuboot / baseline where both exist, ``peer_ratio``
    tpuboot / the peer tool (driverctl, google-guest-agent) measured in the same guest."""

    metric: str
    tpuboot: str
    baseline: str
    ratio: float | None = None
    goal: str = "(info)"
    verdict: str = ""
    peer: str = ""
    peer_ratio: float | None = None
    peer_goal: str = ""
    peer_verdict: str = ""

    def against(self, name: str, shown: str, ratio: float | None, goal: float | None = None) -> Row:
        """This row with the peer ``name``'s figure, its ratio and, with a goal, the verdict."""
        self.peer, self.peer_ratio = f"{name}: {shown}", ratio
        if goal is not None:
            self.peer_goal = f"<= {goal:g}x"
            self.peer_verdict = "n/a" if ratio is None else ("PASS" if ratio <= goal else "FAIL")
        return self

    def at_most(self, name: str, shown: str, ours: float, theirs: float) -> Row:
        """This row against a peer's count (ticks, wakeups, MiB): met when ours <= theirs, even at 0."""
        self.peer, self.peer_ratio = f"{name}: {shown}", ours / theirs if theirs > 0 else None
        self.peer_goal, self.peer_verdict = "<= 1x", "PASS" if ours <= theirs else "FAIL"
        return self


@dataclass
class Report:
    rows: dict[str, list[Row]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def add(self, family: str, row: Row) -> None:
        self.rows.setdefault(family, []).append(row)

    def note(self, family: str, text: str) -> None:
        self.notes.setdefault(family, []).append(text)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def spread(values: Sequence[float]) -> str:
    """``median [min-max]`` in seconds, for the table."""
    if not values:
        return "n/a"
    return f"{median(values):.3f} s [{min(values):.3f}-{max(values):.3f}]"


def median_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float | None:
    return median(ours) / median(theirs) if ours and theirs and median(theirs) > 0 else None


def ratio_row(
    metric: str, tp: Sequence[float], base: Sequence[float], goal: float | None = None, aim: str = ""
) -> Row:
    """A timing row: medians, their ratio and, with a goal, the verdict on that ratio."""
    ratio = median(tp) / median(base) if tp and base and median(base) > 0 else None
    if goal is None:
        return Row(metric, spread(tp), spread(base), ratio)
    verdict = "n/a" if ratio is None else ("PASS" if ratio <= goal else "FAIL")
    return Row(metric, spread(tp), spread(base), ratio, f"<= {goal:g}x{aim}", verdict)


# --------------------------------------------------------------------------- guest plumbing


def guest_json(result: Result, what: str) -> Any:
    """The JSON object a guest helper printed last; BenchError with all its output if none."""
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise BenchError(f"{what}: no result from the guest\n{result.describe()}") from None


def helper(vm: VM, *args: str, timeout: float = 60.0) -> Any:
    """Run a ``bind_guest.py`` subcommand as root in the guest; its JSON, or BenchError if it failed."""
    result = vm.run(["python3", GUEST_HELPER, *args], timeout=timeout)
    data = guest_json(result, args[0])
    if not result.ok:
        raise BenchError(f"guest {args[0]} failed: {json.dumps(data)}\n{result.stderr}")
    return data


class ConsoleTail:
    """Host-clock stamps for guest console markers: QEMU appends to the console file as the guest prints."""

    POLL = 0.001

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        self._file.seek(0, os.SEEK_END)
        self._buf = b""

    def wait_for(self, token: str, timeout: float) -> float:
        """``time.monotonic()`` when ``token`` is first seen; BenchError after ``timeout`` s."""
        needle = token.encode()
        deadline = time.monotonic() + timeout
        while True:
            self._buf += self._file.read()
            at = self._buf.find(needle)
            if at >= 0:
                seen = time.monotonic()
                self._buf = self._buf[at + len(needle) :]
                return seen
            if time.monotonic() > deadline:
                raise BenchError(f"console marker {token!r} not seen within {timeout:.0f} s")
            time.sleep(self.POLL)

    def close(self) -> None:
        self._file.close()


def unit_properties(vm: VM, *names: str, unit: str = "tpuboot") -> dict[str, str]:
    """``systemctl show`` properties of ``unit`` (printed in systemd's order, hence key=value)."""
    out = vm.run(["systemctl", "show", unit, *(f"--property={n}" for n in names)], check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def baseline_rule(vm: VM, active: bool) -> None:
    """Install or remove the baseline's udev rule; udevd re-reads its rules before the next event."""
    place = f"install -m 0644 {STAGED_RULE} {ACTIVE_RULE}" if active else f"rm -f {ACTIVE_RULE}"
    vm.run(f"{place} && udevadm control --reload", check=True)


def stop_tpuboot(vm: VM) -> float:
    """Stop the daemon (and clear its start-limit count); how long ``systemctl stop`` took."""
    stop = vm.run(["systemctl", "stop", "tpuboot"], timeout=60, check=True)
    vm.run(["systemctl", "reset-failed", "tpuboot"])
    return stop.duration


def driverctl_armed(vm: VM, active: bool, addresses: Sequence[str] = ()) -> None:
    """driverctl armed with ``addresses``' overrides saved (bind_guest.py driverctl), or inert."""
    helper(vm, "driverctl", "on" if active else "off", *addresses)


def use_side(vm: VM, side: str, addresses: Sequence[str] = ()) -> float:
    """Make ``side`` the guest's only binder (driverctl: with ``addresses``' overrides saved);
    returns the time ``systemctl stop tpuboot`` took."""
    if side in ("baseline", PEER):
        stopped = stop_tpuboot(vm)
        baseline_rule(vm, side == "baseline")
        driverctl_armed(vm, side == PEER, addresses)
        return stopped
    baseline_rule(vm, False)
    driverctl_armed(vm, False)
    vm.run("systemctl reset-failed tpuboot; systemctl start tpuboot", timeout=120, check=True)
    return 0.0


def unbind_all(vm: VM, addresses: Sequence[str]) -> None:
    drivers = helper(vm, "unbind", *addresses)
    if any(drivers.values()):
        raise BenchError(f"devices still bound after unbind: {drivers}")


@contextmanager
def booted(
    artifacts: Artifacts,
    image: Path,
    name: str,
    vm_class: type[VM] = VM,
    boot_timeout: float = 240.0,
    **kwargs: Any,
) -> Iterator[VM]:
    """A booted guest with tpuboot active, killed afterwards (its disk is a snapshot: nothing to save)."""
    vm = vm_class.from_artifacts(artifacts, image, name=f"bindbench-{name}", **kwargs)
    try:
        vm.start()
        status = vm.wait_booted(boot_timeout)
        log.info("%s: guest booted in %.1f s", name, status.seconds)
        if status.failed_units:
            log.warning("%s: failed units at boot: %s", name, ", ".join(status.failed_units))
        active = vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip()
        if active != "active":
            raise BenchError(f"{name}: tpuboot is {active!r} after boot\n{vm.journal('tpuboot')}")
        yield vm
    finally:
        vm.kill()


def edu_addresses(vm: VM) -> list[str]:
    return [d.address for d in vm.pci_devices(*EDU)]


def check_usable(vm: VM, address: str) -> None:
    """The separate-process proof: vfio_read.py run as tester prints the edu id register."""
    result = vm.run(["python3", VFIO_READ, address], user="tester", timeout=30)
    if result.stdout.strip() != EDU_ID_REGISTER:
        raise BenchError(f"{address} not usable by tester\n{result.describe()}")


def _own_cpu_ticks() -> int:
    """utime+stime of this process, its reaped children (the fleet's emulator) and the bench's
    own QEMU guests, in clock ticks."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if int(pid) != os.getpid() and b"tpuboot-bindbench-" not in cmdline:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        if int(pid) == os.getpid():
            total += int(fields[13]) + int(fields[14])  # cutime, cstime
    return total


def _host_busy_ticks() -> int:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait


class HostLoad:
    """How many cores the rest of the host kept busy meanwhile: other guests slow TCG down."""

    def __init__(self) -> None:
        self._start = (time.monotonic(), _host_busy_ticks(), _own_cpu_ticks())

    def others_cores(self) -> float:
        wall, busy, own = self._start
        elapsed = time.monotonic() - wall
        others = (_host_busy_ticks() - busy) - (_own_cpu_ticks() - own)
        return max(others, 0) / os.sysconf("SC_CLK_TCK") / elapsed if elapsed > 0 else 0.0


# (name, start stamp, end stamp) of tpuboot's stamped runs (bind_guest.py profile). A start is the
# stamp's first occurrence (None: the spawn); an end its last if it is a "<" (function return)
# stamp, else its first; "wall" is the process's end as the parent saw it.
BIND_SEGMENTS = (
    ("python3 start", None, "interpreter"),
    ("import tpuboot.cli", "interpreter", "import tpuboot.cli"),
    ("load config", "> load_config", "< load_config"),
    ("bind(): driver_override, probe", "> _attach", "< _attach"),
    ("bind(): node, udev entry, chmod", "> prepare_node", "< prepare_node"),
    ("bind() whole", "> bind", "< bind"),
    ("main() whole", "import tpuboot.cli", "main returned"),
    ("exit", "main returned", "wall"),
    ("total", None, "wall"),
)
RUN_SEGMENTS = (
    ("python3 start", None, "interpreter"),
    ("import tpuboot.cli", "interpreter", "import tpuboot.cli"),
    ("load config", "> load_config", "< load_config"),
    ("open udev monitor (pyudev)", "> open_udev_monitor", "< open_udev_monitor"),
    ("enumerate, submit binds", "> start_coldplug", "< start_coldplug"),
    ("8 binds, first start -> last end", "> bind", "< bind"),
    ("import daemon/envsync/metadata (beside the binds)",
     "> import daemon, envsync, metadata", "< import daemon, envsync, metadata"),
    ("env sync", "> sync_once", "< sync_once"),
    ("spawn -> last bind end", None, "< bind"),
    ("spawn -> READY", None, "READY"),
)  # fmt: skip


def profile_segments(runs: list[dict[str, Any]], segments: Sequence[tuple[str, str | None, str]]) -> str:
    """Median duration of each segment over the stamped runs, as one line for the notes."""
    values: dict[str, list[float]] = {name: [] for name, _, _ in segments}
    for run in runs:
        stamps: dict[str, list[float]] = {"wall": [run["wall"]]}
        for label, at in run["events"]:
            stamps.setdefault(label, []).append(at)
        for name, start, end in segments:
            if (start is not None and start not in stamps) or end not in stamps:
                continue
            begin = stamps[start][0] if start is not None else 0.0
            finish = stamps[end][-1] if end.startswith("<") else stamps[end][0]
            values[name].append(finish - begin)
    return ", ".join(f"{name} {median(v):.3f} s" for name, v in values.items() if v)


# --------------------------------------------------------------------------- 1. hotplug

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


def run_hotplug(vm: VM, reps: int, report: Report) -> None:
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


# --------------------------------------------------------------------------- 1b. cdi


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


def run_cdi(vm: VM, reps: int, report: Report) -> None:
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


# --------------------------------------------------------------------------- 2. coldplug

ENV_SCRIPT = f"{BENCH_LIBEXEC}/configure-env-vars.sh"
TPU_ENV_FILE = "/home/tpu-runtime/tpu-env"
COLDPLUG_COMMANDS = {  # shell words for bind_guest.py's --command
    "tpuboot": "systemctl start tpuboot",
    # The baseline's boot job: the udev coldplug trigger, then the documented cloud-init script.
    "baseline": shlex.join(
        [
            "sh",
            "-c",
            f"udevadm trigger --settle --action=add --subsystem-match=pci && {ENV_SCRIPT} >/dev/null",
        ]
    ),
    # driverctl's boot job: the same trigger; its rule starts driverctl@pci-DBDF.service per saved
    # override (asynchronously: the poll, not the command, says when all 8 are usable). No tpu-env.
    PEER: "udevadm trigger --settle --action=add --subsystem-match=pci",
}


def tpuboot_start_split(vm: VM) -> dict[str, float]:
    """From the journal of tpuboot's last start: exec -> first/last device bound -> READY (s)."""
    props = unit_properties(
        vm, "InvocationID", "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic"
    )
    out = vm.run(["journalctl", f"_SYSTEMD_INVOCATION_ID={props['InvocationID']}", "-o", "json"], check=True)
    bound = [
        int(entry["__MONOTONIC_TIMESTAMP"])
        for line in out.stdout.splitlines()
        if "bound to vfio-pci" in (entry := json.loads(line)).get("MESSAGE", "")
    ]
    if not bound:
        return {}
    exec_us = int(props["ExecMainStartTimestampMonotonic"])
    return {
        "exec_to_first_bound_s": (min(bound) - exec_us) / 1e6,
        "first_to_last_bound_s": (max(bound) - min(bound)) / 1e6,
        "exec_to_ready_s": (int(props["ActiveEnterTimestampMonotonic"]) - exec_us) / 1e6,
    }


def coldplug_reps(
    vm: VM, addresses: Sequence[str], reps: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``reps`` rounds of each side from all unbound; the reps, and any redone because a device
    was bound again before the start."""
    results: list[dict[str, Any]] = []
    rebound: list[dict[str, Any]] = []
    for i in range(reps):
        for side in SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]:  # each first in turn
            for _attempt in range(3):
                # Unbound with no binder armed and udev idle, then the side armed: a clean start.
                stop_tpuboot(vm)
                baseline_rule(vm, False)
                driverctl_armed(vm, False)
                unbind_all(vm, addresses)
                vm.run(["rm", "-f", TPU_ENV_FILE], check=True)  # each side must write it afresh
                vm.run(["udevadm", "settle", "--timeout=60"], timeout=90)
                baseline_rule(vm, side == "baseline")
                if side == PEER:
                    driverctl_armed(vm, True, addresses)
                command = COLDPLUG_COMMANDS[side]
                data = helper(vm, "coldplug", *addresses, "--command", command, timeout=120)
                if not data["bound_at_start"]:
                    break
                log.warning(
                    "coldplug %s: %s bound again before the start; again", side, data["bound_at_start"]
                )
                rebound.append({"side": side, "rep": i, "bound": data["bound_at_start"]})
            else:
                raise BenchError(f"coldplug {side}: devices keep coming back bound: {rebound}")
            data["side"] = side
            written = vm.run(["grep", "-c", "^[A-Z_]*=", TPU_ENV_FILE]).stdout.strip()
            if side != PEER and (not written.isdigit() or int(written) == 0):
                raise BenchError(f"coldplug {side}: {TPU_ENV_FILE} not written\n{data.get('stderr', '')}")
            if side == "tpuboot":
                data["split"] = tpuboot_start_split(vm)
            results.append(data)
            log.info(
                "coldplug %s: command %.3f s, all usable %.3f s",
                side,
                data["command_s"],
                data["all_usable_s"],
            )
    return results, rebound


def run_coldplug(vm: VM, reps: int, report: Report) -> None:
    addresses = edu_addresses(vm)
    if len(addresses) != 8:
        raise BenchError(f"expected 8 edu devices, the guest has {addresses}")
    check_usable(vm, addresses[0])
    results, rebound = coldplug_reps(vm, addresses, reps)
    status = vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"]).stdout.strip()

    def per_side(key: str) -> dict[str, list[float]]:
        return {s: [r[key] for r in results if r["side"] == s and r[key] is not None] for s in SIDES}

    usable, done = per_side("all_usable_s"), per_side("command_s")
    row = ratio_row(
        f"coldplug 8: start -> all 8 usable (n={reps})", usable["tpuboot"], usable["baseline"], 0.5
    )
    report.add(
        "coldplug",
        row.against(PEER, spread(usable[PEER]), median_ratio(usable["tpuboot"], usable[PEER]), 1.0),
    )
    report.add(
        "coldplug",
        ratio_row(
            f"daemon start -> READY: 8 bound, tpu-env written (n={reps}) | trigger --settle + env script",
            done["tpuboot"],
            done["baseline"],
        ),
    )
    splits = [r["split"] for r in results if r.get("split")]
    if splits:
        first = median([s["exec_to_first_bound_s"] for s in splits])
        spanned = median([s["first_to_last_bound_s"] for s in splits])
        ready = median([s["exec_to_ready_s"] for s in splits])
        report.note(
            "coldplug",
            f"tpuboot's journal, medians: exec -> first 'bound' line logged {first:.3f} s, first -> last "
            f"of 8 logged {spanned:.3f} s (binds started before the daemon loaded log their result once it "
            f"has), exec -> READY {ready:.3f} s",
        )
    report.note(
        "coldplug",
        f"driverctl: `udevadm trigger --settle` returned after {spread(done[PEER])}; its "
        "driverctl@.service units bind after that, and it writes no tpu-env",
    )
    stop_tpuboot(vm)
    baseline_rule(vm, False)
    driverctl_armed(vm, False)
    metadata_env = unit_properties(vm, "Environment")["Environment"].split()
    env_args = [arg for item in metadata_env for arg in ("--env", item)]
    stamped = helper(vm, "profile", "run", *addresses, *env_args, timeout=120)["runs"]
    report.note(
        "coldplug",
        "`tpuboot run` stamped inside (outside systemd's sandbox, after the timed reps): "
        + profile_segments(stamped, RUN_SEGMENTS),
    )
    if rebound:
        report.note("coldplug", f"devices found bound again between unbind and start (rep redone): {rebound}")
    firsts = [min(r["usable_s"].values()) for r in results if r["side"] == "baseline"]
    report.note("coldplug", f"baseline: first of 8 usable after {spread(firsts)}")
    report.raw["coldplug"] = {
        "addresses": addresses,
        "reps": results,
        "rebound": rebound,
        "status": status,
        "stamped": stamped,
    }


# --------------------------------------------------------------------------- 3. cli


def run_cli(vm: VM, runs: int, report: Report) -> None:
    (address,) = edu_addresses(vm)
    stop_tpuboot(vm)
    data = helper(vm, "cli", address, "--runs", str(runs), timeout=600)
    if data["errors"]:
        raise BenchError(f"CLI runs failed: {data['errors']}")
    check_usable(vm, address)
    imports = helper(vm, "imports", timeout=300)["steps"]
    stamped = helper(vm, "profile", "bind", address, "--runs", "3", timeout=300)["runs"]
    times = data["times"]
    report.add(
        "cli",
        ratio_row(
            f"CLI bind: tpuboot vs bind_to_vfio_pci.sh (n={runs})", times["tpuboot"], times["baseline"], 1.5
        ),
    )
    report.add(
        "cli",
        ratio_row(
            "  the same with the shipped config (comments only: no yaml import)",
            times["tpuboot, shipped config"],
            times["baseline"],
        ),
    )
    report.add(
        "cli", ratio_row("  python3 -c pass | bash -c true", times["python3 -c pass"], times["bash -c true"])
    )
    imported = times["import tpuboot.cli"]
    report.add(
        "cli", ratio_row("  python3 -c 'import tpuboot.cli' | bash -c true", imported, times["bash -c true"])
    )
    total_s = sum(step["s"] for step in imports)
    cli_s = sum(step["s"] for step in imports[:3])  # interpreter, yaml, rest of tpuboot.cli
    report.note(
        "cli",
        "start-up of a fresh python3, step by step (best of 2; +wall, +RSS): "
        + "; ".join(f"{s['step']} +{s['s'] * 1000:.0f} ms +{s['rss_kib'] / 1024:.1f} MiB" for s in imports)
        + f". `tpuboot bind` pays the first three ({cli_s:.2f} s; yaml only for a config that sets "
        f"something), `tpuboot run` all ({total_s:.2f} s)",
    )
    report.note(
        "cli", "`tpuboot bind` stamped inside (median of 3): " + profile_segments(stamped, BIND_SEGMENTS)
    )
    usable = helper(vm, "usable", address, "--runs", str(runs), timeout=900)
    if usable["errors"]:
        raise BenchError(f"bind-until-usable runs failed: {usable['errors']}")
    for key, metric in (
        (
            "usable_s",
            f"CLI bind -> usable by tester: tpuboot bind | script | driverctl set-override (n={runs})",
        ),
        ("command_s", "  the same, until the command returns"),
    ):
        values = {side: [r[key] for r in usable["runs"][side]] for side in SIDES}
        ours, peer = values["tpuboot"], values[PEER]
        row = ratio_row(metric, ours, values["baseline"])
        report.add("cli", row.against(PEER, spread(peer), median_ratio(ours, peer), 1.0))
    report.note(
        "cli",
        "bind -> usable: each command run as root while a forked poller, already tester, polls (5 ms) "
        "until the VFIO read succeeds; driverctl with its rules armed and the udev mode rule, the others "
        "with driverctl's rules masked",
    )
    report.raw["cli"] = {"address": address, **data, "imports": imports, "stamped": stamped, "usable": usable}


# --------------------------------------------------------------------------- 3b. icount


def insn(values: Sequence[float]) -> str:
    """Guest seconds under ``-icount shift=0`` as millions of instructions, ``median [min-max]``."""
    if not values:
        return "n/a"
    return f"{median(values) * 1e3:.0f} M [{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]"


def insn_row(metric: str, ours: Sequence[float], base: Sequence[float]) -> Row:
    return Row(metric, insn(ours), insn(base), median_ratio(ours, base))


def run_icount(vm: VM, runs: int, report: Report) -> None:
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


# --------------------------------------------------------------------------- 4. idle


def thread_role(thread: dict[str, Any]) -> tuple[str, str]:
    """A short role and a description of a tpuboot thread, from the call it sleeps in and on what.

    Python 3.11 gives its threads no kernel name, so this is how the threads are told apart.
    """
    call = thread["syscall"]
    if "timeout_ms" in thread:
        call += " (no timeout)" if thread["timeout_ms"] < 0 else f" (timeout {thread['timeout_ms']} ms)"
    waits_on = thread.get("waits_on", "")
    where = f"{call} on {waits_on}" if waits_on else call
    if thread["main"]:
        return "main", f"main thread, the event loop: {where}"
    if "listening on" in waits_on:
        return "server", f"server thread: {where}"
    if waits_on.endswith(f":{MDS_PORT}"):
        return "metadata-watch", f"metadata watch: {where}"
    if waits_on == "unix socket":  # the daemon's one blocking stream socket is dockerd's
        return "docker-events", f"vBar supervisor, following dockerd's events: {where}"
    if thread["syscall"] == "futex":
        return "idle", "waits on a lock or queue (futex): pool worker or a thread being joined"
    return "other", where


def systemd_seconds(span: str) -> float:
    """A systemd time span as ``systemctl show`` prints it (``1min 30s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "min": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)\s*(h|min|ms|us|s)", span))


class IdleFamily:
    """Family 4 in the background: the guest boots in front, its 60 s window runs in a thread.

    Its guest is configured as a TPU VM off GKE is: tpuboot supervises vBar (a stand-in image)
    under a real dockerd, and the window starts once the STATUS line says vBar is running.
    """

    def __init__(self, artifacts: Artifacts, image: Path, window: float) -> None:
        self.artifacts, self.image, self.window = artifacts, image, window
        self._guest = ExitStack()
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None

    def start(self) -> None:
        with ExitStack() as on_error:
            on_error.callback(self.close)
            vm = self._guest.enter_context(
                booted(self.artifacts, self.image, "idle", devices=["edu", "virtio-rng-pci"], memory=1536)
            )
            vm.wait_until(
                "systemctl show -P StatusText tpuboot | grep -q 'vBar: running'", timeout=240, interval=1.0
            )
            props = unit_properties(vm, "MainPID", "WatchdogUSec", "StatusText")
            on_error.pop_all()
        self._result["unit"] = props

        def measure() -> None:
            try:
                self._result["data"] = helper(
                    vm, "idle", props["MainPID"], "--window", str(self.window),
                    "--stats", f"http://127.0.0.1:{MDS_PORT}/_emulator/stats", timeout=self.window + 90,
                )  # fmt: skip
                self._result["peer"] = idle_peer(vm, self.window)
            except BaseException as exc:  # reported by finish(), in the main thread
                self._error = exc

        self._thread = threading.Thread(target=measure, name="idle-window", daemon=True)
        self._thread.start()
        log.info("idle: %.0f s window started", self.window)

    def finish(self, report: Report) -> None:
        """Wait for the window (bounded), stop the guest, add the rows; once."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        thread.join(timeout=2 * self.window + PEER_SETTLE_S + 300)
        self.close()
        if thread.is_alive():
            raise BenchError("idle: the measurement did not end")
        if self._error is not None:
            raise self._error
        idle_report(self._result["data"], self._result["unit"], report, self._result.get("peer"))

    def close(self) -> None:
        """Kill the idle guest (safe to call twice)."""
        self._guest.close()


PEER_SETTLE_S = 30.0  # google-guest-agent's start-up work (users, keys, OS Login) is over by then
GCE_MDS_UNIT = "tpuboot-bench-gce-mds"


def idle_peer(vm: VM, window: float) -> dict[str, Any]:
    """google-guest-agent alone (tpuboot stopped) against the GCE emulator on 169.254.169.254:80,
    over the same window, once its start-up work is over."""
    stop_tpuboot(vm)
    helper(vm, "route-metadata", "--address", peers.GCE_MDS_ADDRESS)
    vm.run(
        ["systemd-run", f"--unit={GCE_MDS_UNIT}", "python3", f"{GUEST_LIBEXEC}/mds_emulator.py",
         "--bind", peers.GCE_MDS_ADDRESS, "--port", "80", "--log-requests",
         "--attributes", "/etc/tpuboot-test/attributes.yaml", "--instance", peers.GCE_INSTANCE_FILE],
        check=True,
    )  # fmt: skip
    url = f"http://{peers.GCE_MDS_ADDRESS}/computeMetadata/v1/instance/id"
    vm.wait_until(f"curl -sf -H 'Metadata-Flavor: Google' {url}", timeout=60, interval=1.0)
    vm.run(["systemctl", "start", "google-guest-agent"], timeout=180, check=True)
    time.sleep(PEER_SETTLE_S)
    props = unit_properties(vm, "MainPID", "ActiveState", unit="google-guest-agent")
    if props.get("ActiveState") != "active" or props.get("MainPID", "0") == "0":
        raise BenchError(f"google-guest-agent is not running: {props}\n{vm.journal('google-guest-agent')}")
    data = helper(
        vm, "idle", props["MainPID"], "--window", str(window),
        "--stats", f"http://{peers.GCE_MDS_ADDRESS}/_emulator/stats", timeout=window + 90,
    )  # fmt: skip
    data["journal"] = vm.journal("google-guest-agent")[-3000:]
    data["requests_log"] = vm.journal(GCE_MDS_UNIT)[-6000:]
    return data


def idle_report(
    data: dict[str, Any], unit: dict[str, str], report: Report, peer: dict[str, Any] | None = None
) -> None:
    window = data["window_s"]
    ping_s = systemd_seconds(unit["WatchdogUSec"]) / 2
    pings = int(window // ping_s) if ping_s else 0
    polls = int(window // LONG_POLL_S)
    rss, sleeper = data["rss_kib"] / 1024, data["sleeper_rss_kib"] / 1024
    verdict = "PASS" if rss <= RSS_GOAL_MIB else "FAIL"
    rss_row = Row("idle RSS: daemon | sleeping python3", f"{rss:.1f} MiB", f"{sleeper:.1f} MiB",
                  rss / sleeper, f"<= {RSS_GOAL_MIB:g} MiB", verdict)  # fmt: skip
    ticks = sum(t["ticks"] for t in data["threads"])
    ticks_row = Row(f"idle CPU over {window:.0f} s (utime+stime)", f"{ticks} ticks", "", None)
    split = Row("  RSS anon + file", split_mib(data), "", None)
    voluntary = sum(t["voluntary"] for t in data["threads"])
    wakeups = Row(
        f"  wakeups (voluntary switches, all threads) over {window:.0f} s", str(voluntary), "", None
    )
    per_minute = Row("idle metadata requests per minute", requests_per_minute(data), "", None)
    if peer is not None:
        gga = "google-guest-agent"
        peer_rss = peer["rss_kib"] / 1024
        rss_row.at_most(gga, f"{peer_rss:.1f} MiB", rss, peer_rss)
        split.at_most(gga, split_mib(peer), data["rss_anon_kib"], peer["rss_anon_kib"])
        peer_ticks = sum(t["ticks"] for t in peer["threads"])
        ticks_row.at_most(gga, f"{peer_ticks} ticks", ticks, peer_ticks)
        peer_voluntary = sum(t["voluntary"] for t in peer["threads"])
        wakeups.at_most(gga, str(peer_voluntary), voluntary, peer_voluntary)
        per_minute.peer = f"{gga}: {requests_per_minute(peer)}"
        report.note(
            "idle",
            f"google-guest-agent {len(peer['threads'])} threads: "
            + "; ".join(
                f"tid {t['tid']} {t['syscall']}: {t['voluntary']} voluntary, {t['ticks']} ticks"
                for t in peer["threads"]
                if t["voluntary"] or t["ticks"]
            ),
        )
        report.raw["idle_peer"] = peer
    report.add("idle", rss_row)
    report.add("idle", split)
    report.add("idle", ticks_row)
    unexpected = 0
    per_role: dict[str, int] = {}
    for t in data["threads"]:
        short, role = thread_role(t)
        # The watchdog pings wake the main thread; a long-poll's end wakes the watch (a reconnect
        # may add one more); nothing else should run.
        allowed = {"main": pings + 1, "metadata-watch": 2 * (polls + 1)}.get(short, 0)
        unexpected += max(t["voluntary"] - allowed, 0)
        per_role[short] = per_role.get(short, 0) + t["voluntary"]
        report.note(
            "idle",
            f"tid {t['tid']} {role}: {t['voluntary']} voluntary + {t['involuntary']} involuntary "
            f"switches, {t['timeslices']} timeslices, {t['ticks']} ticks",
        )
    woke = ", ".join(f"{role} {n}" for role, n in per_role.items())
    report.add(
        "idle",
        Row(f"idle wakeups over {window:.0f} s, per thread", woke,
            f"expected: {pings} pings + <= {polls + 1} long-poll", None, "watchdog + long-poll only",
            "PASS" if unexpected == 0 else f"FAIL (+{unexpected})"),
    )  # fmt: skip
    report.add("idle", wakeups)
    report.add("idle", per_minute)
    report.note(
        "idle",
        f"WatchdogSec={unit['WatchdogUSec']}: a ping every {ping_s:g} s; RSS "
        f"{data['rss_anon_kib'] / 1024:.1f} MiB anon + {data['rss_file_kib'] / 1024:.1f} MiB file; "
        f"status: {unit['StatusText']}",
    )
    where = data.get("anon_kib_by_mapping", {})
    if where:
        report.note(
            "idle",
            "the daemon's anonymous memory by mapping: "
            + "; ".join(f"{kind} {kib / 1024:.1f} MiB" for kind, kib in where.items()),
        )
    report.raw["idle"] = {"unit": unit, **data}


def split_mib(data: dict[str, Any]) -> str:
    return f"{data['rss_anon_kib'] / 1024:.1f} + {data['rss_file_kib'] / 1024:.1f} MiB"


def requests_per_minute(data: dict[str, Any]) -> str:
    count = data.get("metadata_requests")
    return "n/a" if count is None else f"{count * 60 / data['window_s']:.1f}/min"


# --------------------------------------------------------------------------- 5. fleet (host)

FLEET_AGENTS, FLEET_ERROR_RATE, FLEET_OUTAGE_S = 64, 0.2, 5.0


def run_fleet(report: Report) -> None:
    """bench/fleet.py's two scenarios, tpuboot and the documented retry loop each, as table rows."""
    from bench import fleet

    logging.getLogger("tpuboot").setLevel(logging.CRITICAL)  # 64 hosts would each log their retries
    goal = fleet.GOAL_PER_HOST * FLEET_AGENTS
    for label, outage in (("", 0.0), (f", after a {FLEET_OUTAGE_S:g} s outage", FLEET_OUTAGE_S)):
        ours = fleet.run_fleet("tpuboot", fleet.tpuboot_agent, FLEET_AGENTS, FLEET_ERROR_RATE, outage)
        base = fleet.run_fleet("documented", fleet.documented_agent, FLEET_AGENTS, FLEET_ERROR_RATE, outage)
        title = f"fleet of {FLEET_AGENTS}, {FLEET_ERROR_RATE:.0%} of requests fail{label}"
        verdict = "PASS" if ours.peak <= goal and ours.ok == FLEET_AGENTS else "FAIL"
        report.add(
            "fleet",
            Row(
                f"{title}: peak requests/s (1 s windows)",
                f"{ours.peak:.0f}/s",
                f"{base.peak:.0f}/s",
                _ratio(ours.peak, base.peak),
                f"<= {goal:.0f}/s",
                verdict,
            ),
        )
        report.add(
            "fleet", Row("  hosts that got tpu-env", f"{ours.ok}/{ours.agents}", f"{base.ok}/{base.agents}")
        )
        report.add(
            "fleet",
            Row(
                "  requests in all",
                str(ours.requests),
                str(base.requests),
                _ratio(ours.requests, base.requests),
            ),
        )
        for q in (0.5, 0.99):
            mine, theirs = ours.percentile(q), base.percentile(q)
            report.add(
                "fleet",
                Row(
                    f"  time to tpu-env, p{q * 100:g}",
                    f"{mine:.2f} s",
                    f"{theirs:.2f} s",
                    _ratio(mine, theirs),
                ),
            )
        report.raw.setdefault("fleet", []).append(
            {"outage_s": outage, "tpuboot": asdict(ours), "documented": asdict(base)}
        )
    report.note(
        "fleet",
        "baseline: the documented fetch retried every 1 s (no backoff, no jitter); "
        "tpuboot: MetadataClient + EnvSync, one thread per simulated host, emulator in its own process",
    )


def run_holders(report: Report) -> None:
    """bench/holders.py: `tpuboot who` against fuser (the baseline) and lsof (the peer)."""
    from bench import holders

    timings, named = holders.in_namespace()
    ours, fuser, lsof = (timings[name] for name in ("tpuboot who", "fuser -v", "lsof"))
    for what, pick in (("wall", lambda t: t.median), ("cpu", lambda t: t.cpu_median)):
        ratio = _ratio(pick(ours), pick(fuser))
        verdict = "PASS" if ratio is not None and ratio <= holders.GOAL else "FAIL"
        row = Row(
            f"who on 2000 processes x 50 files: {what} time (baseline fuser -v)",
            f"{pick(ours) * 1000:.0f} ms",
            f"{pick(fuser) * 1000:.0f} ms",
            ratio,
            f"<= {holders.GOAL:g}x",
            verdict,
        )
        peer = f"{pick(lsof) * 1000:.0f} ms"
        report.add("holders", row.against("lsof", peer, _ratio(pick(ours), pick(lsof))))
    missing = {t.name: sorted(named - t.pids) for t in timings.values() if not t.pids >= named}
    said = f"every tool named the {len(named)} holders" if not missing else f"missed: {missing}"
    report.note("holders", said)


def _ratio(ours: float, base: float) -> float | None:
    return ours / base if base and not math.isnan(base) and not math.isnan(ours) else None


# --------------------------------------------------------------------------- image, table, main


def bench_install_hook(package: InstallHook, peer_debs: Sequence[Path] = ()) -> InstallHook:
    """``package`` (tpuboot from its .deb, as the tests install it), the baseline files, the
    guest helper and the peers (``bench/peers.py``: installed, inert)."""

    def install(tree: Path) -> None:
        package(tree)
        libexec = in_tree(tree, BENCH_LIBEXEC)
        libexec.mkdir(parents=True, exist_ok=True)
        shutil.copy(HERE / "bind_guest.py", libexec / "bind_guest.py")
        shutil.copy(HERE / "baseline" / RULE_NAME, libexec / RULE_NAME)
        shutil.copy(HERE / "baseline" / "configure-env-vars.sh", libexec / "configure-env-vars.sh")
        shutil.copy(HERE.parent / "conf" / "tpuboot.yaml", libexec / "tpuboot.yaml")
        (libexec / "configure-env-vars.sh").chmod(0o755)
        handler = in_tree(tree, HANDLER)
        shutil.copy(HERE / "baseline" / "bind_to_vfio_pci.sh", handler)
        handler.chmod(0o755)
        if peer_debs:
            peers.peers_install_hook(peer_debs)(tree)

    return install


IDLE_VBAR_IMAGE = "tpuboot-bench/vbar:1"


def idle_install_hook(deb: Path) -> InstallHook:
    """The idle guest: vBar supervised from a stand-in image, named by tpu-env as on a TPU VM."""
    # A local name, which dockerd reads as Docker Hub's.
    config = guest_config(
        vbar={"enabled": True, "image": IDLE_VBAR_IMAGE, "registries": ["docker.io/tpuboot-bench"]}
    )
    tpu_env = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": IDLE_VBAR_IMAGE}
    return vbar_install_hook(deb, config, tpu_env, [IDLE_VBAR_IMAGE])


def tree_revision() -> str:
    """The commit measured, and whether tpuboot's files had uncommitted changes (the .deb has them)."""
    git = ["git", "-c", "safe.directory=*", "-C", str(HERE.parent)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "tpuboot", "debian", "systemd", "udev", "conf"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def print_table(report: Report) -> None:
    header = ("metric", "tpuboot", "baseline", "ratio", "goal", "verdict", "peer", "ratio", "goal", "verdict")
    rows = [r for f in FAMILIES for r in report.rows.get(f, [])]
    lines = [table_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    print()
    for line in [header, tuple("-" * w for w in widths), *lines]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    print()
    for family in FAMILIES:
        for note in report.notes.get(family, []):
            print(f"* {family}: {note}")


def table_cells(r: Row) -> tuple[str, ...]:
    """A row's cells: metric, tpuboot, the documented baseline (ratio, goal, verdict), the peer (same)."""

    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}x"

    return (r.metric, r.tpuboot, r.baseline, ratio(r.ratio), r.goal, r.verdict,
            r.peer, ratio(r.peer_ratio), r.peer_goal, r.peer_verdict)  # fmt: skip


def markdown_table(report: Report) -> str:
    """The table as Markdown, for the README."""
    lines = [
        "| metric | tpuboot | documented | ratio | goal | verdict | peer | ratio | goal | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for f in FAMILIES for r in report.rows.get(f, [])):
        cells = [c.replace("|", "/") for c in table_cells(r)]
        metric = cells[0].strip()
        cells[0] = f"&nbsp;&nbsp;{metric}" if r.metric.startswith(" ") else metric
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description="tpuboot's benchmarks, each against its baseline, in one run."
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="also write the table as Markdown to FILE"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--only", default=",".join(FAMILIES), help=f"families to run (default {','.join(FAMILIES)})"
    )
    parser.add_argument("--reps", type=int, default=6, help="hotplug adds per side (default 6)")
    parser.add_argument("--coldplug-reps", type=int, default=5, help="coldplug runs per side (default 5)")
    parser.add_argument("--cli-runs", type=int, default=10, help="CLI runs per side (default 10)")
    parser.add_argument("--icount-runs", type=int, default=5, help="icount guest runs per side (default 5)")
    parser.add_argument("--idle-window", type=float, default=60.0, help="idle window in s (default 60)")
    args = parser.parse_args(argv)
    args.families = [f.strip() for f in args.only.split(",") if f.strip()]
    if unknown := set(args.families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    started = time.monotonic()

    def probe(kernel: Any, initrd: Path) -> None:  # overlaps the KVM/TCG probe with the builds
        threading.Thread(target=select_accel, args=(kernel.boot_image, initrd), daemon=True).start()

    report = Report()
    crowd: dict[str, float] = {}
    revision = tree_revision()
    if set(args.families) & set(VM_FAMILIES):
        run_guests(args, report, crowd, probe)
    if "fleet" in args.families:  # on the host, after the last guest is gone
        t, load = time.monotonic(), HostLoad()
        run_fleet(report)
        crowd["fleet"] = round(load.others_cores(), 2)
        log.info("fleet: measured in %.0f s", time.monotonic() - t)
    if "holders" in args.families:
        t, load = time.monotonic(), HostLoad()
        run_holders(report)
        crowd["holders"] = round(load.others_cores(), 2)
        log.info("holders: measured in %.0f s", time.monotonic() - t)
    report.raw["total_s"] = time.monotonic() - started
    report.raw["revision"] = revision
    report.raw["host_cores_used_by_others"] = crowd
    print_table(report)
    if crowd:
        load = ", ".join(f"{name} {cores:.2f}" for name, cores in crowd.items())
        print(f"* host: cores kept busy by other processes while measuring (of {os.cpu_count()}): {load}")
    print(f"\ntpuboot {revision}; total {report.raw['total_s']:.0f} s")
    if args.json:
        payload = {
            "rows": {f: [asdict(r) for r in rows] for f, rows in report.rows.items()},
            "notes": report.notes,
            "raw": report.raw,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown_table(report))
    return 0


def run_guests(
    args: argparse.Namespace, report: Report, crowd: dict[str, float], probe: Callable[[Any, Path], None]
) -> None:
    """Families 1-4: one .deb, one guest image, one guest per family (idle's in the background)."""
    artifacts = ensure_artifacts(on_boot_files=probe)
    work = Path(tempfile.mkdtemp(prefix="bindbench-", dir=cache_dir()))
    measures: dict[str, tuple[dict[str, Any], Callable[[VM], None]]] = {
        "hotplug": ({"hotplug_ports": 1}, lambda vm: run_hotplug(vm, args.reps, report)),
        "cdi": ({"hotplug_ports": 1}, lambda vm: run_cdi(vm, args.reps, report)),
        "coldplug": ({"devices": ["edu"] * 8}, lambda vm: run_coldplug(vm, args.coldplug_reps, report)),
        "cli": ({"devices": ["edu"]}, lambda vm: run_cli(vm, args.cli_runs, report)),
        "icount": (
            {"devices": ["edu"] * 8, "smp": 1, "vm_class": IcountVM, "boot_timeout": 900},
            lambda vm: run_icount(vm, args.icount_runs, report),
        ),
    }
    idle: IdleFamily | None = None
    try:
        deb = build_deb(work / "deb")
        peer_debs = peers.download_peers(cache_dir())
        versions = {d.name.split("_")[0]: peers.deb_version(d) for d in peer_debs}
        report.raw["peers"] = versions
        report.note("hotplug", "peers: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
        hook = bench_install_hook(package_install_hook(deb), peer_debs)
        image = build_image(artifacts, work / "bindbench.ext4", hook)
        if "idle" in args.families:
            hook = bench_install_hook(idle_install_hook(deb), peer_debs)
            vbar_image = build_image(artifacts, work / "bindbench-vbar.ext4", hook)
            idle = IdleFamily(artifacts, vbar_image, args.idle_window)
            idle.start()
        for name in (f for f in VM_FAMILIES if f in args.families and f != "idle"):
            kwargs, measure = measures[name]
            with booted(artifacts, image, name, **kwargs) as vm:
                if idle is not None:
                    idle.finish(report)  # no timing while the idle window runs
                t, load = time.monotonic(), HostLoad()
                measure(vm)
                crowd[name] = round(load.others_cores(), 2)
                log.info("%s: measured in %.0f s", name, time.monotonic() - t)
        if idle is not None:
            idle.finish(report)
    finally:
        if idle is not None:
            idle.close()
        remove_tree(work)


if __name__ == "__main__":
    sys.exit(main())
