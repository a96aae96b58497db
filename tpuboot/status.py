"""What every TPU on the machine looks like right now, for `tpuboot status` and the daemon."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from tpuboot.pci import PciFunction, list_addresses
from tpuboot.vfio import VFIO_PCI, Binder


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


def describe(binder: Binder, fn: PciFunction) -> TpuStatus | None:
    """The status of one function, or None when it is not in the device table."""
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
        node = f"/dev/vfio/{group}"
        try:
            mode = f"{os.stat(binder.root.path(node)).st_mode & 0o7777:04o}"
        except FileNotFoundError:
            node = None
        if blockers:
            problem = f"group {group} not viable: {', '.join(blockers)}"
    if kind.vfio:
        if group is None:
            problem = "no IOMMU group: add intel_iommu=on to the kernel command line"
        elif driver != VFIO_PCI:
            driven = driver or "no driver"
            problem = problem or f"driven by {driven}, not vfio-pci: run `tpuboot bind {fn.address}`"
        elif mode is not None and int(mode, 8) != binder.config.node_mode:
            problem = problem or f"{node} has mode {mode}, not {binder.config.node_mode:04o}"
        elif node is None:
            problem = problem or f"/dev/vfio/{group} is missing"
    return TpuStatus(fn.address, kind.name, str(ids), kind.vfio, driver, group, node, mode, viable, problem)


def survey(binder: Binder) -> list[TpuStatus]:
    """Every device of the table present on this machine, in address order."""
    found = []
    for address in list_addresses(binder.root):
        try:
            status = describe(binder, PciFunction(binder.root, address))
        except FileNotFoundError:  # removed while we looked
            continue
        if status is not None:
            found.append(status)
    return found
