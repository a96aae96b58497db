"""The QEMU machine a test drives: :class:`VM`.

A q35 machine with an emulated Intel IOMMU (so every PCI device gets its own
IOMMU group and vfio-pci really works), the root disk on virtio-blk (a
non-TPU device tpuboot must leave alone), cold-plugged stand-in devices,
empty PCIe root ports for hotplug, no NIC. The host reaches the guest three
ways: the console log file (ttyS0), the command server (ttyS1) and QMP.

Every wait is bounded, and no QEMU outlives its VM: ``close()`` runs on
context exit (also on KeyboardInterrupt), an ``atexit`` hook kills leftovers,
and QEMU started from the main thread dies with the Python process
(PR_SET_PDEATHSIG) even if that is killed outright.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from uuid import uuid4

from .accel import accel_args, select_accel
from .artifacts import Artifacts
from .guestcmd import GuestCmdClient, GuestCmdError, Result
from .hostenv import QEMU
from .qmp import QMPClient, QMPError

log = logging.getLogger("tpuboot.vm")

KEEP_ENV = "TPUBOOT_VM_KEEP"  # set to 1 to keep each VM's work folder (console log, sockets)
HOTPLUG_PORT_PREFIX = "hp"
WORKDIR_PREFIX = "tpuboot-vm-"
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-~])")  # CSI sequences and two-byte escapes
ROOT_DISK_ID = "rootdisk"
# The guest kernel's words for a vCPU that did not run for many seconds: under TCG that is the
# emulator starved by its host, and a boot that shows them and then times out is booted again once.
_STALL = re.compile(
    r"soft lockup - CPU#\d+ stuck for|rcu: INFO: rcu_\w+ (?:self-)?detected (?:expedited )?stall"
)


class VMError(RuntimeError):
    """The machine did not start, boot, or stop as expected."""


class VMTestTimeout(Exception):
    """A VM test ran past its overall time limit (raised by the conftest's alarm)."""


@dataclass(frozen=True)
class BootStatus:
    """Where ``systemctl is-system-running --wait`` ended, and how long it took."""

    state: str
    failed_units: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class PciDevice:
    """One PCI function as the guest's sysfs shows it."""

    address: str
    vendor: int
    device: int
    driver: str | None
    iommu_group: int | None


# Guest-side lister for PciDevice (python3 is in the guest; one round trip).
_PCI_LIST = r"""
import json, os
base = "/sys/bus/pci/devices"
out = []
for addr in sorted(os.listdir(base)):
    d = os.path.join(base, addr)
    def link(name):
        p = os.path.join(d, name)
        return os.path.basename(os.readlink(p)) if os.path.islink(p) else None
    out.append({"address": addr,
                "vendor": int(open(d + "/vendor").read(), 16),
                "device": int(open(d + "/device").read(), 16),
                "driver": link("driver"), "iommu_group": link("iommu_group")})
print(json.dumps(out))
"""

_serials = itertools.count(1)
_registry: list[weakref.ref[VM]] = []
_registry_lock = threading.Lock()


def guest_stalled(console: str) -> str | None:
    """The first line of ``console`` in which the guest kernel reports a stalled vCPU, if any."""
    match = _STALL.search(console)
    if match is None:
        return None
    start = console.rfind("\n", 0, match.start()) + 1
    end = console.find("\n", match.end())
    return console[start : end if end >= 0 else len(console)].strip()


_PANIC = re.compile(r"Kernel panic - not syncing[^\n]*")
_COMM = re.compile(r"\bComm: (\S+)")


def early_panic(console: str) -> str | None:
    """The panic line if the guest kernel panicked before running any program of the guest (every
    task its oopses name is the kernel's own ``swapper``, PID 1 included: /init never ran), as
    multi-threaded TCG can make it do (an int3 oops in a text-poke under a racing vCPU)."""
    panic = _PANIC.search(console)
    tasks = _COMM.findall(console)
    if panic is None or not tasks or not all(task.startswith("swapper/") for task in tasks):
        return None
    return panic.group().strip()


def vms_started_since(serial: int) -> list[VM]:
    """VMs of this process started with a serial >= ``serial`` (for failure reports)."""
    with _registry_lock:
        vms = [ref() for ref in _registry]
    return [vm for vm in vms if vm is not None and vm.serial >= serial]


def next_serial() -> int:
    """The serial the next started VM will get (no VM consumes it by asking)."""
    with _registry_lock:
        vms = [ref() for ref in _registry]
    return max((vm.serial for vm in vms if vm is not None), default=0) + 1


def live_vms() -> list[VM]:
    with _registry_lock:
        vms = [ref() for ref in _registry]
    return [vm for vm in vms if vm is not None and vm.running]


@atexit.register
def _kill_leftovers() -> None:
    for vm in live_vms():
        vm.kill()


def _opt(path: Path) -> str:
    """A path as a QEMU option value (a comma is written as two)."""
    return str(path).replace(",", ",,")


def _sweep_workdirs() -> None:
    """Remove work folders of VMs whose Python process died without cleaning up (SIGKILL)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            owner = int((folder / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel kills QEMU when the thread that forked it ends.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class VM:
    """A QEMU guest booting ``kernel`` + ``initrd`` with ``image`` as its root disk.

    ``devices`` are ``-device`` specifications (``"edu"``, ``"virtio-rng-pci,id=rng0"``).
    ``hotplug_ports`` empty ``pcie-root-port``s are created with ids ``hp0``, ``hp1``...
    (see :attr:`hotplug_ports`) for :meth:`device_add`. ``accel`` is ``kvm``/``tcg``,
    default the probed choice. ``reboot=False`` makes QEMU exit when the guest reboots
    or panics; with ``reboot=True`` :meth:`reboot` works (snapshot data survives it).
    ``quiet=True`` keeps kernel chatter off the serial console (2-3 s faster boot
    under TCG; errors and the initramfs's messages still show, and the journal
    has everything).
    """

    def __init__(
        self,
        image: Path,
        kernel: Path,
        initrd: Path,
        *,
        cmdline_extra: str = "",
        iommu: bool = True,
        devices: Sequence[str] = (),
        hotplug_ports: int = 0,
        memory: int = 1024,
        smp: int = 2,
        accel: str | None = None,
        reboot: bool = False,
        quiet: bool = True,
        name: str = "vm",
        workdir: Path | None = None,
        uuid: str | None = None,
    ) -> None:
        self.image = Path(image)
        self.kernel = Path(kernel)
        self.initrd = Path(initrd)
        self.cmdline_extra = cmdline_extra
        self.iommu = iommu
        self.devices = list(devices)
        self.hotplug_ports = [f"{HOTPLUG_PORT_PREFIX}{i}" for i in range(hotplug_ports)]
        self.memory = memory
        self.smp = smp
        self.accel = accel
        self.reboot_allowed = reboot
        self.quiet = quiet
        self.name = name
        # The SMBIOS system UUID (QEMU's -uuid), the guest's product_uuid: one per VM, as GCE gives
        # each instance (tpuboot's cache is tied to it), unless a test names it.
        self.uuid = uuid if uuid is not None else str(uuid4())
        # For QEMU's -name and the work folder: no commas (QEMU option syntax), short
        # enough for the 108-byte limit on unix socket paths.
        self._safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
        self._workdir_arg = workdir
        self.workdir: Path | None = None
        self.serial = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.guestcmd: GuestCmdClient | None = None
        self._qmp: QMPClient | None = None
        self.started_at = 0.0
        self.boot_status: BootStatus | None = None
        self.final_journal: str | None = None  # kept by capture_journal (on a failing exit)
        self._console_text: str | None = None
        self._ready_mark = 0  # guestcmd ready events before this index belong to earlier boots
        self._lock = threading.Lock()

    @classmethod
    def from_artifacts(cls, artifacts: Artifacts, image: Path, **kwargs: Any) -> VM:
        """A VM booting the cached kernel and initramfs."""
        return cls(image, artifacts.boot_kernel, artifacts.initrd, **kwargs)

    # ------------------------------------------------------------------ lifecycle

    def kernel_cmdline(self) -> str:
        # no_timer_check: a slow TCG guest can fail the IO-APIC timer test with intremap=on and panic.
        args = ["console=ttyS0,115200", "root=/dev/vda", "rw", "panic=-1", "no_timer_check"]
        if self.iommu:
            args.append("intel_iommu=on")
        if self.quiet:
            args.append("quiet")
        if self.cmdline_extra:
            args.append(self.cmdline_extra)
        return " ".join(args)

    def qemu_argv(self) -> list[str]:
        """The full QEMU command line (valid once :meth:`start` chose accel and workdir)."""
        assert self.workdir is not None and self.accel is not None
        machine = "q35,kernel-irqchip=split" if self.accel == "kvm" else "q35"
        argv = [
            QEMU, "-name", f"tpuboot-{self._safe_name}", "-machine", machine, *accel_args(self.accel),
            "-nodefaults", "-nographic", "-no-user-config", "-smp", str(self.smp), "-m", str(self.memory),
        ]  # fmt: skip
        if not self.reboot_allowed:
            argv.append("-no-reboot")
        argv += ["-uuid", self.uuid]
        if self.iommu:
            # Before any other PCI device, so that all of them sit behind it.
            argv += ["-device", "intel-iommu,intremap=on"]
        argv += [
            "-kernel", str(self.kernel), "-initrd", str(self.initrd), "-append", self.kernel_cmdline(),
            "-drive", f"file={_opt(self.image)},format=raw,if=none,id={ROOT_DISK_ID},snapshot=on",
            "-device", f"virtio-blk-pci,drive={ROOT_DISK_ID},id={ROOT_DISK_ID}-dev",
            "-chardev", f"file,id=console,path={_opt(self.console_path)}",
            "-serial", "chardev:console",
            "-chardev", f"socket,id=guestcmd,path={_opt(self.workdir / 'guestcmd.sock')},server=on,wait=off",
            "-serial", "chardev:guestcmd",
            "-chardev", f"socket,id=qmp,path={_opt(self.workdir / 'qmp.sock')},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
        ]  # fmt: skip
        for i, port in enumerate(self.hotplug_ports):
            argv += ["-device", f"pcie-root-port,id={port},chassis=1,slot={i + 1}"]
        for spec in self.devices:
            argv += ["-device", spec]
        return argv

    @property
    def console_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "console.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> VM:
        """Launch QEMU and connect QMP and the guestcmd channel (does not wait for the boot)."""
        if self.proc is not None:
            raise VMError(f"{self.name}: already started")
        for path in (self.image, self.kernel, self.initrd):
            if not path.is_file():
                raise VMError(f"{self.name}: {path} does not exist")
        if self.accel is None:
            self.accel = select_accel(self.kernel, self.initrd)
        if self._workdir_arg is not None:
            self.workdir = Path(self._workdir_arg)
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            _sweep_workdirs()
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{self._safe_name}-"))
        (self.workdir / "owner.pid").write_text(str(os.getpid()))
        argv = self.qemu_argv()
        (self.workdir / "qemu-argv.json").write_text(json.dumps(argv, indent=1))
        in_main = threading.current_thread() is threading.main_thread()
        with _registry_lock:
            self.serial = next(_serials)
            _registry.append(weakref.ref(self))
        self.started_at = time.monotonic()
        try:
            with open(self.workdir / "qemu.log", "wb") as qemu_log:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=qemu_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches pytest, which then cleans up
                    preexec_fn=_die_with_parent if in_main else None,
                )
        except OSError as exc:
            self.close()
            raise VMError(f"{self.name}: cannot start {QEMU}: {exc}") from exc
        log.info("%s: QEMU pid %d (%s), workdir %s", self.name, self.proc.pid, self.accel, self.workdir)
        try:
            self._qmp = QMPClient(self.workdir / "qmp.sock")
            self._connect(self._qmp.connect)
            self.guestcmd = GuestCmdClient(self.workdir / "guestcmd.sock")
            self._connect(self.guestcmd.connect)
        except BaseException:
            self.kill()
            raise
        return self

    def _connect(self, connect: Any) -> None:
        try:
            connect(timeout=15.0)
        except (QMPError, GuestCmdError) as exc:
            raise VMError(f"{self.name}: {exc}\n{self._qemu_log()}") from exc

    def _qemu_log(self) -> str:
        path = self.workdir / "qemu.log" if self.workdir else None
        text = path.read_text(errors="replace").strip() if path and path.is_file() else ""
        return f"QEMU output: {text}" if text else "QEMU printed nothing"

    def _check_alive(self, doing: str) -> None:
        if self.proc is None:
            raise VMError(f"{self.name}: not started")
        rc = self.proc.poll()
        if rc is not None:
            raise VMError(
                f"{self.name}: QEMU exited ({rc}) while {doing}; {self._qemu_log()}\n"
                f"--- console tail ---\n{self.console_tail(40)}"
            )

    def wait_booted(self, timeout: float = 240.0, *, fault_retries: int = 1) -> BootStatus:
        """Wait for guestcmd, then for systemd to finish starting (running or degraded).

        Raises VMError with the console tail if QEMU dies or time runs out. A
        degraded boot is returned, not raised: ``failed_units`` says which failed.
        A boot that ran out of time after the guest kernel reported a stalled vCPU
        (:func:`guest_stalled`), or that ended in a kernel panic before /init ran
        (:func:`early_panic`), starts again, up to ``fault_retries`` times: a
        deterministic fault fails every time, a starved or racing emulator does not.
        """
        try:
            return self._wait_booted(timeout)
        except VMError:
            console = self.console_log()
            fault = guest_stalled(console) or early_panic(console)
            if fault_retries <= 0 or fault is None:
                raise
            log.warning("%s: the emulated guest failed before its boot was ours (%s); booting it again",
                        self.name, fault)  # fmt: skip
            self.restart()
            return self.wait_booted(timeout, fault_retries=fault_retries - 1)

    def restart(self) -> VM:
        """Kill QEMU and start the same machine from its unchanged image (``snapshot=on``)."""
        self.kill()
        self.proc = self.guestcmd = self._qmp = None
        self.workdir = None
        self._console_text = None
        self._ready_mark = 0
        self.boot_status = None
        return self.start()

    def _wait_booted(self, timeout: float) -> BootStatus:
        if self.guestcmd is None:
            raise VMError(f"{self.name}: not started")
        deadline = time.monotonic() + timeout
        self._wait_guestcmd(self._ready_mark, deadline, "booting")
        guestcmd_at = time.monotonic()
        left = max(deadline - time.monotonic(), 5.0)
        result = self.run(["systemctl", "is-system-running", "--wait"], timeout=left)
        if result.timed_out:
            jobs = self.run(["systemctl", "list-jobs", "--no-pager"], timeout=30).stdout
            raise VMError(
                f"{self.name}: systemd still starting after {timeout:.0f}s; pending jobs:\n{jobs}\n"
                f"--- console tail ---\n{self.console_tail(60)}"
            )
        state = result.stdout.strip()
        if state not in ("running", "degraded"):
            raise VMError(
                f"{self.name}: systemd state {state!r} after boot\n{self._failed_report()}\n"
                f"--- console tail ---\n{self.console_tail(60)}"
            )
        failed = self.failed_units() if state == "degraded" else ()
        self.boot_status = BootStatus(state, failed, time.monotonic() - self.started_at)
        log.info(
            "%s: guestcmd after %.1fs, %s after %.1fs%s",
            self.name, guestcmd_at - self.started_at, state, self.boot_status.seconds,
            f"; failed units: {', '.join(failed)}" if failed else "",
        )  # fmt: skip
        return self.boot_status

    def _wait_guestcmd(self, mark: int, deadline: float, doing: str) -> dict[str, Any]:
        """Wait for guestcmd's ready event after ``mark``; then a ping proves the round trip."""
        assert self.guestcmd is not None
        last_ping = time.monotonic()
        while True:
            self._check_alive(doing)
            ready = self.guestcmd.wait_ready(mark, timeout=min(2.0, max(deadline - time.monotonic(), 0.0)))
            if ready is not None:
                pong = self.guestcmd.ping(timeout=max(deadline - time.monotonic(), 10.0))
                if pong is not None:
                    return pong
            elif time.monotonic() - last_ping > 20.0:
                # Fallback in case the ready line was garbled: rarely, so that pings do
                # not queue up in the UART before guestcmd opens it.
                last_ping = time.monotonic()
                pong = self.guestcmd.ping(timeout=1.0)
                if pong is not None:
                    return pong
            if time.monotonic() > deadline:
                raise VMError(
                    f"{self.name}: guestcmd silent while {doing}\n"
                    f"--- console tail ---\n{self.console_tail(60)}"
                )

    def failed_units(self) -> tuple[str, ...]:
        out = self.run(["systemctl", "--failed", "--plain", "--no-legend", "--no-pager"], timeout=30).stdout
        return tuple(line.split()[0] for line in out.splitlines() if line.strip())

    def _failed_report(self) -> str:
        try:
            return self.run(["systemctl", "--failed", "--no-pager"], timeout=30).stdout
        except (GuestCmdError, VMError) as exc:
            return f"(cannot list failed units: {exc})"

    def reboot(self, timeout: float = 240.0) -> BootStatus:
        """Reboot the guest (needs ``reboot=True``) and wait for the new boot."""
        if not self.reboot_allowed:
            raise VMError(f"{self.name}: created with reboot=False; QEMU would exit")
        assert self.guestcmd is not None
        before = self.guestcmd.ping(timeout=10.0)
        if not before:
            raise VMError(f"{self.name}: guestcmd not answering before reboot")
        deadline = time.monotonic() + timeout
        mark = self.guestcmd.ready_count()
        self.run(["systemctl", "reboot", "--no-block"], timeout=30, check=True)
        while True:
            pong = self._wait_guestcmd(mark, deadline, "rebooting")
            if pong.get("boot_id") != before.get("boot_id"):
                break
            mark = self.guestcmd.ready_count()  # guestcmd restarted within the old boot
        self.started_at = time.monotonic() - float(pong.get("uptime", 0.0))
        self._ready_mark = self.guestcmd.ready_count() - 1
        return self.wait_booted(max(deadline - time.monotonic(), 30.0))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Clean poweroff through systemd; QMP quit and then SIGKILL if it takes too long."""
        if not self.running:
            self.close()
            return
        assert self.proc is not None
        asked = False
        if self.guestcmd is not None and not self.guestcmd.closed:
            try:
                asked = self.run(["systemctl", "poweroff", "--no-block"], timeout=10).ok
            except (GuestCmdError, VMError):
                asked = False
        if not asked:
            with contextlib.suppress(QMPError):
                self.qmp("system_powerdown")
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s: no poweroff within %.0fs; quitting QEMU", self.name, timeout)
            try:
                self.qmp("quit", timeout=5)
                self.proc.wait(timeout=5)
            except (QMPError, subprocess.TimeoutExpired):
                pass
        self.close()

    def kill(self) -> None:
        """Stop QEMU at once (SIGKILL) and clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("%s: QEMU pid %d survived SIGKILL", self.name, self.proc.pid)
        self.close()

    def close(self) -> None:
        """Release everything; kills QEMU if it still runs. Safe to call twice."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            for client in (self.guestcmd, self._qmp):
                if client is not None:
                    client.close()
            if self.workdir is not None and self._console_text is None:
                self._console_text = self._read_console()
                if self._workdir_arg is None and os.environ.get(KEEP_ENV) != "1":
                    shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VM:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.shutdown()
            return
        # Keep what explains the failure before the guest is gone.
        if self.running and exc_type is not KeyboardInterrupt:
            self.capture_journal()
        self.kill()

    # ------------------------------------------------------------------ guest commands

    def run(
        self,
        command: Sequence[str] | str,
        *,
        user: str | None = None,
        timeout: float = 60.0,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        check: bool = False,
    ) -> Result:
        """Run an argv list, or a shell string, in the guest as root or ``user``.

        ``check=True`` raises CommandFailed (an AssertionError) with all output
        on a non-zero exit or a timeout.
        """
        if self.guestcmd is None:
            raise VMError(f"{self.name}: not started")
        try:
            result = self.guestcmd.run(command, user=user, timeout=timeout, stdin=stdin, env=env, cwd=cwd)
        except GuestCmdError as exc:
            self._check_alive(f"running {command!r}")
            raise VMError(f"{self.name}: {exc} (command {command!r})") from exc
        return result.check() if check else result

    def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None, user: str | None = None
    ) -> None:
        """Create or replace a guest file (parents created) with ``data``."""
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        if mode is not None:
            script += f' && chmod {mode:o} "$1"'
        self.run(["sh", "-c", script, "sh", path], stdin=data, user=user, check=True)

    def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return self.run(["cat", path], user=user, check=True).stdout_bytes

    def wait_until(self, sh_condition: str, *, timeout: float = 10.0, interval: float = 0.05) -> None:
        """Poll a shell condition inside the guest (one round trip); VMError on timeout."""
        loops = max(int(timeout / interval), 1)
        script = (
            f"i=0; while [ $i -lt {loops} ]; do if {sh_condition}; then exit 0; fi; "
            f"sleep {interval}; i=$((i+1)); done; exit 1"
        )
        result = self.run(script, timeout=timeout + 10)
        if not result.ok:
            raise VMError(f"{self.name}: condition not met within {timeout:.0f}s: {sh_condition}")

    def pci_devices(self, vendor: int | None = None, device: int | None = None) -> list[PciDevice]:
        """PCI functions from the guest's sysfs, optionally filtered by ids."""
        raw = json.loads(self.run(["python3", "-c", _PCI_LIST], check=True).stdout)
        devs = [
            PciDevice(d["address"], d["vendor"], d["device"], d["driver"],
                      int(d["iommu_group"]) if d["iommu_group"] is not None else None)
            for d in raw
        ]  # fmt: skip
        return [
            d
            for d in devs
            if (vendor is None or d.vendor == vendor) and (device is None or d.device == device)
        ]

    def journal(self, unit: str | None = None, *, lines: int | None = None, timeout: float = 60.0) -> str:
        """This boot's journal (optionally one unit's, optionally only the last ``lines``)."""
        argv = ["journalctl", "-b", "--no-pager", "-o", "short-monotonic"]
        if unit:
            argv += ["-u", unit]
        if lines:
            argv += ["-n", str(lines)]
        return self.run(argv, timeout=timeout).stdout

    def capture_journal(self, lines: int = 300) -> str:
        """The journal's tail, also kept in :attr:`final_journal` for after the guest is gone.

        Asks only if guestcmd answers a ping within 3 s, so a hung guest costs little.
        """
        if not self.running or self.guestcmd is None or self.guestcmd.closed:
            return self.final_journal or "(guest not running: no journal; see the console)"
        try:
            if self.guestcmd.ping(timeout=3.0) is None:
                return self.final_journal or "(guestcmd not answering: no journal; see the console)"
            self.final_journal = self.journal(lines=lines, timeout=30)
        except (GuestCmdError, VMError) as exc:
            self.final_journal = f"(journal unavailable: {exc})"
        return self.final_journal

    def _read_console(self) -> str:
        if self.workdir is None or not self.console_path.is_file():
            return ""
        return self.console_path.read_text(errors="replace")

    def console_log(self) -> str:
        """Everything the guest printed on ttyS0 (kernel, initramfs, systemd)."""
        return self._console_text if self._console_text is not None else self._read_console()

    def console_tail(self, lines: int = 50) -> str:
        """The last ``lines`` of the console, terminal escape sequences removed."""
        text = _ANSI.sub("", self.console_log()).replace("\r", "")
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ QMP

    def qmp(self, command: str, timeout: float = 30.0, **arguments: Any) -> Any:
        """Execute a QMP command; returns its ``return`` value."""
        if self._qmp is None:
            raise VMError(f"{self.name}: not started")
        return self._qmp.execute(command, timeout=timeout, **arguments)

    @property
    def qmp_events(self) -> list[dict[str, Any]]:
        return list(self._qmp.events) if self._qmp else []

    def device_add(self, driver: str, id: str, bus: str, **props: Any) -> None:
        """Hot-add ``driver`` as ``id`` into root port ``bus`` (one of :attr:`hotplug_ports`)."""
        self.qmp("device_add", driver=driver, id=id, bus=bus, **props)

    def device_del(self, id: str, timeout: float = 30.0) -> None:
        """Request removal and wait for DEVICE_DELETED (the guest must release the device)."""
        assert self._qmp is not None
        mark = self._qmp.event_count()
        self.qmp("device_del", id=id)
        try:
            self._qmp.wait_event(
                "DEVICE_DELETED", since=mark, match=lambda e: e.get("data", {}).get("device") == id,
                timeout=timeout,
            )  # fmt: skip
        except QMPError as exc:
            raise VMError(f"{self.name}: device {id} not removed within {timeout:.0f}s") from exc
