"""What every TPU on the machine looks like right now, for `tpuboot status` and the daemon."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from tpuboot.devices.kmodule import NO_VFIO_PCI_FIX, ModuleState, module_state
from tpuboot.devices.pci import PciFunction, list_addresses
from tpuboot.devices.vfio import IOMMU_OFF_FIX, VFIO_PCI, Binder, group_node, os_failure, vfio_pci_registered


@dataclass(frozen=True)
class TpuStatus:
    address: str
    kind: str
    ids: str
    managed: bool  # tpuboot binds this kind to vfio-pci
    driver: str | None
    iommu_group: str | None
    node: str | None
    node_mode: str | None
    viable: bool | None
    problem: str | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def vfio_pci_state(binder: Binder) -> ModuleState | None:
    """How vfio-pci is in the running kernel; None when its driver is registered (nothing to say)."""
    if vfio_pci_registered(binder.root):
        return None
    return module_state(binder.root, VFIO_PCI)


def driver_summary(binder: Binder) -> str:
    """One line on vfio-pci itself: on Ubuntu it is built in, and lsmod shows nothing for it."""
    state = module_state(binder.root, VFIO_PCI)
    registered = vfio_pci_registered(binder.root)
    how = {
        "built-in": f"built into {state.kernel}",
        "loaded": f"loaded as a module of {state.kernel}",
        "loadable": f"a module of {state.kernel}, not loaded (tpuboot loads it to bind a TPU)",
        "absent": f"not in {state.kernel}: {NO_VFIO_PCI_FIX}",
        "unknown": "origin unknown",
    }[state.origin]
    return f"vfio-pci: {how}; driver {'registered' if registered else 'not registered'}"


def describe(binder: Binder, fn: PciFunction, vfio: ModuleState | None = None) -> TpuStatus | None:
    """The status of one function, or None when it is not in the device table.

    ``vfio``: vfio-pci's state when its driver is not registered, so an unbound TPU's problem
    says whether `tpuboot bind` can help (it cannot on a kernel without vfio-pci).
    """
    ids = fn.ids()
    kind = binder.table.classify(ids)
    if kind is None:
        return None
    driver, group = fn.driver(), fn.iommu_group()
    node = mode = None
    viable: bool | None = None
    problem = None
    if group is not None:
        blockers = binder.group_blockers(group, fn.address)
        viable = not blockers
        node = group_node(group)
        try:
            mode = f"{os.stat(binder.root.path(node)).st_mode & 0o7777:04o}"
        except FileNotFoundError:
            node = None
        if blockers:
            problem = f"group {group} not viable: {', '.join(blockers)}"
    if kind.vfio:
        if group is None:
            problem = f"no IOMMU group, the IOMMU is off; {IOMMU_OFF_FIX}"
        elif driver != VFIO_PCI and vfio is not None and vfio.origin == "absent":
            problem = problem or f"{vfio.kernel} has no vfio-pci: {NO_VFIO_PCI_FIX}"
        elif driver != VFIO_PCI:
            driven = driver or "no driver"
            problem = problem or f"driven by {driven}, not vfio-pci: run `tpuboot bind {fn.address}`"
        elif mode is not None and int(mode, 8) != binder.config.node_mode:
            problem = problem or f"{node} has mode {mode}, not {binder.config.node_mode:04o}"
        elif node is None:
            problem = problem or f"{group_node(group)} is missing"
    return TpuStatus(fn.address, kind.name, str(ids), kind.vfio, driver, group, node, mode, viable, problem)


def survey(binder: Binder) -> list[TpuStatus]:
    """Every device of the table present on this machine, in address order."""
    found = []
    vfio = vfio_pci_state(binder)
    for address in list_addresses(binder.root):
        fn = PciFunction(binder.root, address)
        try:
            status = describe(binder, fn, vfio)
        except FileNotFoundError:  # removed while we looked
            continue
        except OSError as exc:
            status = _unreadable(binder, fn, exc)
        if status is not None:
            found.append(status)
    return found


def _unreadable(binder: Binder, fn: PciFunction, exc: OSError) -> TpuStatus | None:
    """A function whose sysfs state could not be read (EIO, EACCES): a TPU with that problem, or,
    when even its ids are unreadable, a device that may be a TPU and so cannot be vouched for."""
    problem = f"{os_failure(fn.address, 'reading its sysfs state', exc)}"
    try:
        ids = fn.ids()
    except OSError:
        return TpuStatus(fn.address, "unknown", "unreadable", True, None, None, None, None, None, problem)
    kind = binder.table.classify(ids)
    if kind is None:
        return None
    return TpuStatus(fn.address, kind.name, str(ids), kind.vfio, None, None, None, None, None, problem)
