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
from pathlib import Path

from tpuboot import subproc
from tpuboot.config import VfioConfig
from tpuboot.devices import DeviceTable, Kind
from tpuboot.errors import DeviceError, IommuOffError, TpubootError, TransientDeviceError
from tpuboot.paths import Root
from tpuboot.pci import DRIVERS_PROBE, PCI_DRIVERS, PciFunction, group_members

log = logging.getLogger("tpuboot.vfio")

VFIO_PCI = "vfio-pci"
UNSAFE_INTERRUPTS = "/sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts"
# Drivers the kernel accepts beside vfio-pci in a viable group (pcieport manages its own DMA).
VIABLE_DRIVERS = {VFIO_PCI, "pci-stub", "pcieport"}
POLL_INTERVAL = 0.01


def write_attr(path: Path, value: str) -> None:
    """Write a sysfs attribute in one write(2), as the kernel expects (no create, no truncate)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def modprobe(module: str) -> None:
    subproc.run(["modprobe", module])


class BindResult:
    """What a bind did: the device, its generation, its group and node, and whether it changed."""

    __slots__ = ("address", "changed", "group", "kind", "node")

    def __init__(self, address: str, kind: str, group: str, node: str, changed: bool) -> None:
        self.address = address
        self.kind = kind
        self.group = group
        self.node = node
        self.changed = changed


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

    def _host_modprobe(self, module: str) -> None:
        if not self.root.is_host:
            raise DeviceError(
                f"{module} is not loaded under {self.root.prefix}; tpuboot loads modules only on the host"
            )
        modprobe(module)

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
        """Bind ``address`` to vfio-pci and make its node usable; idempotent."""
        fn = self.function(address)
        kind = self._check_bindable(fn, force)
        group = fn.iommu_group()
        if group is None:  # checked before unbinding, so the device keeps its driver
            raise IommuOffError(
                f"{address}: no IOMMU group, the IOMMU is off; add intel_iommu=on (Intel) or "
                "amd_iommu=on (AMD) to the kernel command line and reboot"
            )
        self._ensure_driver()
        changed = self._attach(fn)
        self._check_viable(fn, group)
        self._allow_unsafe_interrupts()
        node = self.prepare_node(group)
        return BindResult(address, kind, group, node, changed)

    def _ensure_driver(self) -> None:
        """The driver registered: already (built in, as on Ubuntu, or loaded), else modprobe it.

        A built-in driver has nothing to load; a kernel whose module lists name no vfio-pci still
        gets a modprobe (the lists may be stale), and its failure says which kernel lacks it.
        """
        driver = self.root.path(f"{PCI_DRIVERS}/{VFIO_PCI}")
        if driver.is_dir():
            return
        from tpuboot.kmodule import NO_VFIO_PCI_FIX, module_state  # rare: kept out of `tpuboot bind`

        state = module_state(self.root, VFIO_PCI)
        if state.origin != "built-in":
            try:
                self.load_module(VFIO_PCI)
            except TpubootError as exc:
                if state.origin == "absent":
                    raise DeviceError(
                        f"{state.kernel} has no vfio-pci, neither built in nor as a module; {NO_VFIO_PCI_FIX}"
                    ) from None
                raise DeviceError(f"cannot load vfio-pci ({exc}); {NO_VFIO_PCI_FIX}") from None
        if not driver.is_dir():
            raise DeviceError(
                f"vfio-pci is {state.origin} in {state.kernel} ({state.evidence}) but "
                f"{PCI_DRIVERS}/{VFIO_PCI} is missing; check dmesg"
            )

    def _attach(self, fn: PciFunction) -> bool:
        """Move ``fn`` to vfio-pci; False when it was already there."""
        if fn.driver_override() != VFIO_PCI:
            self._write(fn.path / "driver_override", VFIO_PCI)
        current = fn.driver()
        if current == VFIO_PCI:
            return False
        if current is not None:
            log.info("%s: unbinding from %s", fn.address, current, extra={"DBDF": fn.address})
            self._write(fn.path / "driver" / "unbind", fn.address)
        try:
            self._write(self.root.path(DRIVERS_PROBE), fn.address)
        except DeviceError as exc:
            log.debug("%s: drivers_probe: %s", fn.address, exc, extra={"DBDF": fn.address})
        now = fn.driver()  # a successful probe write proves nothing: re-read the link
        if now != VFIO_PCI:
            raise TransientDeviceError(
                f"{fn.address}: vfio-pci did not take the device (driver is {now or 'none'}); see dmesg"
            )
        return True

    def _write(self, path: Path, value: str) -> None:
        try:
            self.write(path, value)
        except OSError as exc:
            where = self.root.strip(path)
            reason = errno.errorcode.get(exc.errno or 0, str(exc))
            raise TransientDeviceError(f"writing {value!r} to {where} failed ({reason}); see dmesg") from None

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

    def _allow_unsafe_interrupts(self) -> None:
        wanted = self.config.allow_unsafe_interrupts
        if wanted == "false" or (wanted == "auto" and self.machine != "x86_64"):
            return
        path = self.root.path(UNSAFE_INTERRUPTS)
        if not path.exists():  # built in (Ubuntu), the parameter is there from boot
            try:
                self.load_module("vfio_iommu_type1")
            except TpubootError as exc:
                raise DeviceError(f"cannot load vfio_iommu_type1 ({exc}); check dmesg") from None
        if not path.exists():  # else read_text's FileNotFoundError would read as "device removed"
            raise DeviceError(
                f"{UNSAFE_INTERRUPTS} is missing; set vfio.allow_unsafe_interrupts: false if this "
                "kernel's IOMMU remaps interrupts, else check dmesg"
            )
        if path.read_text().strip() not in ("Y", "1"):
            self._write(path, "1")
            log.info("enabled vfio_iommu_type1 allow_unsafe_interrupts")

    # --- the /dev/vfio node ------------------------------------------------------------

    def prepare_node(self, group: str) -> str:
        """Wait for ``/dev/vfio/<group>`` and udev's handling of it, then set the configured mode."""
        node = f"/dev/vfio/{group}"
        real = self.root.path(node)
        deadline = time.monotonic() + self.config.node_timeout
        st = self._wait(lambda: _stat(real), deadline)
        if st is None:
            raise TransientDeviceError(
                f"{node} did not appear within {self.config.node_timeout:g} s; see dmesg"
            )
        # udev may still apply its own rules to a fresh node: wait for its database entry so
        # our chmod comes last (only where udev runs; never a global settle).
        if self.root.path("/run/udev/control").exists():
            entry = self.root.path(f"/run/udev/data/c{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
            self._wait(entry.exists, deadline)
        if st.st_mode & 0o7777 != self.config.node_mode:
            os.chmod(real, self.config.node_mode)
        return node

    def _wait(self, probe: Callable[[], object], deadline: float) -> object:
        """Poll ``probe`` until truthy, the deadline, or stop; bounded, for a node that is usually there."""
        while True:
            value = probe()
            if value or time.monotonic() >= deadline or self.stop.is_set():
                return value
            self.stop.wait(POLL_INTERVAL)

    # --- unbind -------------------------------------------------------------------------

    def unbind(self, address: str, *, force: bool = False) -> str | None:
        """Give ``address`` back to the kernel's default driver; returns the new driver."""
        fn = self.function(address)
        self._check_bindable(fn, force)
        if fn.driver_override() is not None:
            self._write(fn.path / "driver_override", "\n")
        if fn.driver() is not None:
            self._write(fn.path / "driver" / "unbind", address)
        try:
            self._write(self.root.path(DRIVERS_PROBE), address)
        except DeviceError as exc:
            log.debug("%s: drivers_probe: %s", address, exc, extra={"DBDF": address})
        return fn.driver()


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
