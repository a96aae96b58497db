"""Driving the bench's guest: its helper (``bench/in_guest/bind_guest.py``), which side is armed (tpuboot, the
documented udev rule and handler, or driverctl), the console as a clock, the guest image's bench
files, and how busy the rest of the host was meanwhile.

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
BAR0 identification register, 0x010000ed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import peers
from bench.table import median
from harness.vm.artifacts import (
    Artifacts,
    InstallHook,
    in_tree,
)
from harness.vm.guestcmd import Result
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    VFIO_READ,
)

log = logging.getLogger("bench.bind")

HERE = Path(__file__).resolve().parent
BENCH_LIBEXEC = "/usr/local/libexec/tpuboot-bench"
GUEST_HELPER = f"{BENCH_LIBEXEC}/bind_guest.py"
RULE_NAME = "99-tpu-vfiopci.rules"
STAGED_RULE = f"{BENCH_LIBEXEC}/{RULE_NAME}"
ACTIVE_RULE = f"/etc/udev/rules.d/{RULE_NAME}"
HANDLER = "/lib/udev/bind_to_vfio_pci.sh"
HOTPLUG_PORT = "hp0"
SIDES = ("tpuboot", "baseline", "driverctl")  # the binding families' sides, one armed at a time
PEER = "driverctl"


class BenchError(RuntimeError):
    """A scenario could not be measured: the guest did not behave as the bench expects."""


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


def bench_install_hook(package: InstallHook, peer_debs: Sequence[Path] = ()) -> InstallHook:
    """``package`` (tpuboot from its .deb, as the tests install it), the baseline files, the
    guest helper and the peers (``bench/peers.py``: installed, inert)."""

    def install(tree: Path) -> None:
        package(tree)
        libexec = in_tree(tree, BENCH_LIBEXEC)
        libexec.mkdir(parents=True, exist_ok=True)
        for module in (HERE / "in_guest").glob("*.py"):  # bind_guest.py and the modules it imports
            shutil.copy(module, libexec / module.name)
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
