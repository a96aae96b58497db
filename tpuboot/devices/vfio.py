"""Binding a PCI function to vfio-pci by writing sysfs, and making its VFIO node usable.

The sequence is the documented one (driver_override, unbind, drivers_probe) with the checks
the shell version lacks: refuse non-TPUs, check the IOMMU before unbinding anything, re-read
the driver link after probing, check the group's viability, and wait for the specific
``/dev/vfio/<group>`` node (and udev's processing of it) before setting its mode.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpuboot import subproc
from tpuboot.config import Config, TriState, VfioConfig, decided
from tpuboot.devices.pci import DRIVERS_PROBE, PCI_DRIVERS, PciFunction, group_members
from tpuboot.devices.table import DeviceTable, Kind
from tpuboot.errors import DeviceError, IommuOffError, TpubootError, TransientDeviceError
from tpuboot.kernel_params import IOMMU_PARAM
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.devices.vfio")

VFIO_PCI = "vfio-pci"
#: The driver's directory, there once vfio-pci is registered (built in, or its module loaded).
VFIO_PCI_DRIVER = f"{PCI_DRIVERS}/{VFIO_PCI}"
UNSAFE_INTERRUPTS = "/sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts"
#: What to do when a TPU has no IOMMU group (the IOMMU is off): every message that says so ends so.
IOMMU_OFF_FIX = (
    f"add {IOMMU_PARAM} to the kernel command line (tpuboot's GRUB drop-in does on x86_64), "
    "update-grub and reboot"
)
# Drivers the kernel accepts beside vfio-pci in a viable group (pcieport manages its own DMA).
VIABLE_DRIVERS = {VFIO_PCI, "pci-stub", "pcieport"}
POLL_INTERVAL = 0.01

#: Errnos a bind step may see that the kernel or the device can clear on its own within the
#: daemon's retry series: the device or a driver is busy (EBUSY, EAGAIN, EINTR), the device is in
#: reset, hot-plugged or being removed (EIO, ENODEV, ENXIO, ETIMEDOUT: sysfs answers ENODEV for an
#: attribute of a device being torn down), something just seen is gone while the device is still
#: there (ENOENT: a node unbound by someone else; the retry re-reads everything), or the kernel is
#: short of memory (ENOMEM, ENOBUFS).
#: Every other errno says the setup is wrong and a retry changes nothing: a permission or LSM
#: denial (EPERM, EACCES), a read-only /sys or /dev (EROFS), a value the kernel refuses (EINVAL),
#: a full file system (ENOSPC, EDQUOT), or one this table does not know; those fail at once and
#: wait for the admin (a new udev event or a restart starts a fresh series).
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EBUSY,
        errno.EINTR,
        errno.EIO,
        errno.ENODEV,
        errno.ENXIO,
        errno.ETIMEDOUT,
        errno.ENOENT,
        errno.ENOMEM,
        errno.ENOBUFS,
    }
)
#: What to do about a permanent errno, in the message (default: see dmesg).
# Root owns every sysfs attribute and /dev/vfio node tpuboot writes, so no capability is missing
# when it runs as root (tpuboot.service does): a denial then is a security module's.
_DENIED = (
    "run tpuboot as root (tpuboot.service does); as root, an LSM (AppArmor, SELinux) denied it: "
    "see the audit log"
)
ERRNO_FIXES = {
    errno.EPERM: _DENIED,
    errno.EACCES: _DENIED,
    errno.EROFS: "/sys and /dev must be writable: run tpuboot on the host, not in a read-only container",
    errno.ENOSPC: "free space on the file system named",
    errno.EDQUOT: "free space on the file system named",
}
#: Refusals by policy: a failed drivers_probe with one of these is reported as such, not as a
#: probe that did not take (which is retried).
POLICY_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.EROFS})


class DeviceGoneError(DeviceError):
    """The device was unplugged while a step ran; the daemon waits for its next add event."""


def os_failure(address: str, step: str, exc: OSError) -> DeviceError:
    """One device step's OSError as that device's error: one line, transient by errno (see above)."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    text = f"{address}: {step} failed ({name}: {exc.strerror or os.strerror(code)}); "
    if code in TRANSIENT_ERRNOS:
        return TransientDeviceError(text + "see dmesg")
    return DeviceError(text + ERRNO_FIXES.get(code, "see dmesg"))


def group_node(group: str) -> str:
    """The node of IOMMU group ``group`` (any number of digits), which a VFIO user opens."""
    return f"/dev/vfio/{group}"


def vfio_pci_registered(root: Root) -> bool:
    """Whether the running kernel has vfio-pci as a driver (built in or loaded): lsmod cannot say."""
    return root.path(VFIO_PCI_DRIVER).is_dir()


def unsafe_interrupts_wanted(setting: TriState, machine: str) -> bool:
    """Whether tpuboot sets vfio_iommu_type1's allow_unsafe_interrupts: ``vfio.allow_unsafe_interrupts``
    (true, false, or auto: on x86_64 only) on a kernel of architecture ``machine``."""
    wanted = decided(setting)
    return machine == "x86_64" if wanted is None else wanted


def write_attr(path: Path, value: str) -> None:
    """Write a sysfs attribute in one write(2), as the kernel expects (no create, no truncate)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def modprobe(module: str) -> None:
    subproc.run(["modprobe", module])


@dataclass(frozen=True)
class BindResult:
    """What a bind did: the device, its generation, its group and node, and whether it changed."""

    address: str
    kind: str
    group: str
    node: str
    changed: bool


class Binder:
    """Binds and unbinds PCI functions under a Root.

    ``write`` and ``load_module`` are the only ways it changes the kernel's state, so a
    test can stand in for the kernel; ``stop`` cuts short every wait when the daemon exits.
    """

    def __init__(
        self,
        root: Root,
        table: DeviceTable,
        config: VfioConfig,
        *,
        write: Callable[[Path, str], None] = write_attr,
        load_module: Callable[[str], None] | None = None,
        machine: str | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.root = root
        self.table = table
        self.config = config
        self.write = write
        self.load_module = load_module or self._host_modprobe
        self.machine = machine or os.uname().machine  # what platform.machine() reads, without its import
        self.stop = stop or threading.Event()

    @classmethod
    def of(cls, root: Root, config: Config) -> Binder:
        """The binder the configuration describes (its device table and vfio section)."""
        return cls(root, DeviceTable(config.devices), config.vfio)

    def _host_modprobe(self, module: str) -> None:
        if not self.root.is_host:
            raise DeviceError(
                f"{module} is not loaded under {self.root.prefix}; tpuboot loads modules only on the host"
            )
        try:
            modprobe(module)
        except OSError as exc:  # fork or exec refused (EAGAIN, ENOMEM, EACCES): not a sysfs path
            raise os_failure(module, "running modprobe", exc) from None

    # --- classification -------------------------------------------------------------

    def function(self, address: str) -> PciFunction:
        fn = PciFunction(self.root, address)
        if not fn.exists():
            raise DeviceError(f"{address}: no such PCI device; `tpuboot status` lists the TPUs present")
        return fn

    def kind_of(self, fn: PciFunction) -> Kind | None:
        return self.table.classify(fn.ids())

    def _check_bindable(self, fn: PciFunction, force: bool) -> str:
        kind = self.kind_of(fn)
        if kind is not None and kind.vfio:
            return kind.name
        if force:
            return kind.name if kind else f"forced {fn.ids()}"
        what = f"a {kind.name}, which tpuboot does not bind" if kind else "not a TPU"
        holder = fn.driver()
        held = f" and is driven by {holder} (it may be the boot disk or the NIC)" if holder else ""
        raise DeviceError(
            f"{fn.address} ({fn.ids()}) is {what}{held}; refusing, pass --force if you are sure"
        )

    # --- bind ---------------------------------------------------------------------------

    def bind(self, address: str, *, force: bool = False) -> BindResult:
        """Bind ``address`` to vfio-pci and make its node usable; idempotent.

        Every OSError of every step comes out as this device's DeviceError (transient by errno),
        so a caller's per-device boundary needs to know only TpubootError.
        """
        try:
            return self._bind(address, force)
        except OSError as exc:
            raise self._failure(address, exc) from None

    def _failure(self, address: str, exc: OSError) -> DeviceError:
        """An OSError no step named: gone if the device is, else the path and errno."""
        if isinstance(exc, (FileNotFoundError, NotADirectoryError)) and not os.path.isdir(
            PciFunction(self.root, address).path
        ):
            return DeviceGoneError(f"{address}: removed during bind")
        return os_failure(address, f"access to {self._where(exc.filename)}", exc)

    def _where(self, filename: object) -> str:
        """A path in a message, as the host names it."""
        if not isinstance(filename, (str, os.PathLike)):
            return "sysfs"
        try:
            return self.root.strip(Path(filename))
        except ValueError:
            return str(filename)

    def _bind(self, address: str, force: bool) -> BindResult:
        fn = self.function(address)
        kind = self._check_bindable(fn, force)
        group = fn.iommu_group()
        if group is None:  # checked before unbinding, so the device keeps its driver
            raise IommuOffError(f"{address}: no IOMMU group, the IOMMU is off; {IOMMU_OFF_FIX}")
        self._ensure_driver()
        changed = self._attach(fn)
        self._check_viable(fn, group)
        self._allow_unsafe_interrupts(fn.address)
        node = self.prepare_node(group, fn.address)
        return BindResult(address, kind, group, node, changed)

    def _ensure_driver(self) -> None:
        """The driver registered: already (built in, as on Ubuntu, or loaded), else modprobe it.

        A built-in driver has nothing to load; a kernel whose module lists name no vfio-pci still
        gets a modprobe (the lists may be stale), and its failure says which kernel lacks it.
        """
        if vfio_pci_registered(self.root):
            return
        from tpuboot.devices.kmodule import NO_VFIO_PCI_FIX, module_state

        state = module_state(self.root, VFIO_PCI)
        if state.origin != "built-in":
            try:
                self.load_module(VFIO_PCI)
            except TpubootError as exc:
                if exc.transient:  # a modprobe that ran out of time (a loaded boot): retried later
                    raise TransientDeviceError(f"cannot load vfio-pci yet ({exc}); retrying") from None
                if state.origin == "absent":
                    raise DeviceError(
                        f"{state.kernel} has no vfio-pci, neither built in nor as a module; {NO_VFIO_PCI_FIX}"
                    ) from None
                raise DeviceError(f"cannot load vfio-pci ({exc}); {NO_VFIO_PCI_FIX}") from None
        if not vfio_pci_registered(self.root):
            raise DeviceError(
                f"vfio-pci is {state.origin} in {state.kernel} ({state.evidence}) but "
                f"{VFIO_PCI_DRIVER} is missing; check dmesg"
            )

    def _attach(self, fn: PciFunction) -> bool:
        """Move ``fn`` to vfio-pci; False when it was already there."""
        if fn.driver_override() != VFIO_PCI:
            self._write(fn.path / "driver_override", VFIO_PCI, fn.address)
        current = fn.driver()
        if current == VFIO_PCI:
            return False
        if current is not None:
            log.info("%s: unbinding from %s", fn.address, current, extra={"DBDF": fn.address})
            self._write(fn.path / "driver" / "unbind", fn.address, fn.address)
        probe = self.root.path(DRIVERS_PROBE)
        probe_error = ""
        try:
            self.write(probe, fn.address)
        except OSError as exc:  # a probe error proves no more than a success: the link decides
            if exc.errno in POLICY_ERRNOS:
                raise os_failure(fn.address, f"writing {fn.address!r} to {DRIVERS_PROBE}", exc) from None
            probe_error = f", drivers_probe: {errno.errorcode.get(exc.errno or 0, exc.errno)}"
            log.debug("%s: drivers_probe: %s", fn.address, exc, extra={"DBDF": fn.address})
        now = fn.driver()  # a successful probe write proves nothing: re-read the link
        if now != VFIO_PCI:
            raise TransientDeviceError(
                f"{fn.address}: vfio-pci did not take the device (driver is {now or 'none'}{probe_error}); "
                "see dmesg"
            )
        return True

    def _write(self, path: Path, value: str, address: str) -> None:
        try:
            self.write(path, value)
        except OSError as exc:
            raise os_failure(address, f"writing {value.strip()!r} to {self._where(path)}", exc) from None

    def group_blockers(self, group: str, address: str) -> list[str]:
        """Other endpoints of the group bound to a driver that makes it not viable."""
        blockers = []
        for member in group_members(self.root, group):
            if member == address:
                continue
            driver = PciFunction(self.root, member).driver()
            if driver is not None and driver not in VIABLE_DRIVERS:
                blockers.append(f"{member} ({driver})")
        return blockers

    def _check_viable(self, fn: PciFunction, group: str) -> None:
        blockers = self.group_blockers(group, fn.address)
        if blockers:
            raise TransientDeviceError(
                f"{fn.address}: IOMMU group {group} is not viable: {', '.join(blockers)} "
                "still bound to a host driver; bind them to vfio-pci too"
            )

    def _allow_unsafe_interrupts(self, address: str) -> None:
        if not unsafe_interrupts_wanted(self.config.allow_unsafe_interrupts, self.machine):
            return
        path = self.root.path(UNSAFE_INTERRUPTS)
        if not path.exists():  # built in (Ubuntu), the parameter is there from boot
            try:
                self.load_module("vfio_iommu_type1")
            except TpubootError as exc:
                if exc.transient:
                    why = f"cannot load vfio_iommu_type1 yet ({exc}); retrying"
                    raise TransientDeviceError(why) from None
                raise DeviceError(f"cannot load vfio_iommu_type1 ({exc}); check dmesg") from None
        if not path.exists():  # else read_text's FileNotFoundError would read as "device removed"
            raise DeviceError(
                f"{UNSAFE_INTERRUPTS} is missing; set vfio.allow_unsafe_interrupts: false if this "
                "kernel's IOMMU remaps interrupts, else check dmesg"
            )
        if path.read_text().strip() not in ("Y", "1"):
            self._write(path, "1", address)
            log.info("enabled vfio_iommu_type1 allow_unsafe_interrupts")

    # --- the /dev/vfio node ------------------------------------------------------------

    def prepare_node(self, group: str, who: str | None = None) -> str:
        """Wait for ``/dev/vfio/<group>`` and udev's handling of it, then set the configured mode.

        Any OSError is a DeviceError of ``who`` (the device, else the group) naming the node.
        """
        node = group_node(group)
        try:
            return self._prepare_node(group, node)
        except OSError as exc:
            who = who or f"IOMMU group {group}"
            if exc.filename is not None and self._where(exc.filename) == node and exc.errno != errno.ENOENT:
                step = f"setting {node} to mode {self.config.node_mode:04o}"
            else:
                step = f"preparing {node} ({self._where(exc.filename)})"
            raise os_failure(who, step, exc) from None

    def _prepare_node(self, group: str, node: str) -> str:
        real = self.root.path(node)
        deadline = time.monotonic() + self.config.node_timeout
        if not self._wait(real.exists, deadline):
            raise TransientDeviceError(
                f"{node} did not appear within {self.config.node_timeout:g} s; see dmesg"
            )
        # udev may still apply its own rules to a fresh node: wait for its database entry so
        # our chmod comes last (only where udev runs; never a global settle).
        st = os.stat(real)  # gone again by now: an ENOENT, retried as any other
        if self.root.path("/run/udev/control").exists():
            entry = self.root.path(f"/run/udev/data/c{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
            self._wait(entry.exists, deadline)
        if st.st_mode & 0o7777 != self.config.node_mode:
            os.chmod(real, self.config.node_mode)
        return node

    def _wait(self, probe: Callable[[], bool], deadline: float) -> bool:
        """Poll ``probe`` until true, the deadline, or stop; bounded, for a node that is usually there."""
        while True:
            value = probe()
            if value or time.monotonic() >= deadline or self.stop.is_set():
                return value
            self.stop.wait(POLL_INTERVAL)

    # --- unbind -------------------------------------------------------------------------

    def unbind(self, address: str, *, force: bool = False) -> str | None:
        """Give ``address`` back to the kernel's default driver; returns the new driver."""
        try:
            return self._unbind(address, force)
        except OSError as exc:
            raise self._failure(address, exc) from None

    def _unbind(self, address: str, force: bool) -> str | None:
        fn = self.function(address)
        self._check_bindable(fn, force)
        if fn.driver_override() is not None:
            self._write(fn.path / "driver_override", "\n", address)
        if fn.driver() is not None:
            self._write(fn.path / "driver" / "unbind", address, address)
        try:
            self._write(self.root.path(DRIVERS_PROBE), address, address)
        except DeviceError as exc:
            log.debug("%s: drivers_probe: %s", address, exc, extra={"DBDF": address})
        return fn.driver()
