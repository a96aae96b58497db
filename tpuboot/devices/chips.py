"""TPU chips as a runtime sees them: one or more PCI functions, and the device nodes it opens.

A chip is not always one PCI function: v2, v3 and TPU7x chips are two, which share a base address
(domain:bus:device), and tpu-info and GKE's TPU device plugin count chips by grouping functions on
it. Chip counts (doctor against the machine type), who holds a chip, and the CDI devices all
start from this one grouping, numbered in base-address order as tpu-info numbers them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tpuboot.devices.pci import PCI_DEVICES
from tpuboot.devices.table import ACCEL_ACCESS, VFIO_ACCESS, DeviceTable
from tpuboot.devices.vfio import VFIO_PCI, group_node
from tpuboot.paths import Root

#: The VFIO container node every process that uses a VFIO group opens beside the group's node.
VFIO_CONTAINER = "/dev/vfio/vfio"


def base_address(dbdf: str) -> str:
    """``dddd:bb:dd`` of ``dddd:bb:dd.f``: the functions of one chip share it."""
    return dbdf.rpartition(".")[0]


def accel_nodes(root: Root, dbdf: str) -> tuple[str, ...]:
    """The accel driver's nodes of one function (``/dev/accelN``), from its sysfs ``accel`` class
    directory; () when no accel driver serves it."""
    try:
        names = os.listdir(root.path(f"{PCI_DEVICES}/{dbdf}/accel"))
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(f"/dev/{name}" for name in sorted(names) if name.startswith("accel"))


class SurveyedFunction(Protocol):
    """What :func:`chips_present` reads of a survey's record (``survey.TpuStatus`` has it)."""

    @property
    def address(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def driver(self) -> str | None: ...
    @property
    def iommu_group(self) -> str | None: ...


@dataclass(frozen=True)
class ChipFunction:
    """One PCI function of a chip: what the grouping needs of a survey or of the device manager."""

    address: str  # dddd:bb:dd.f
    kind: str  # the device table's name for it
    group: str | None  # its IOMMU group while bound to vfio-pci, else None
    accel: tuple[str, ...] = ()  # its /dev/accelN nodes, for chips the accel driver serves


@dataclass(frozen=True)
class Chip:
    """One chip: its functions (in address order) and what a runtime opens to use it."""

    index: int  # 0, 1, ... in base-address order
    address: str  # the base address dddd:bb:dd
    kind: str
    access: str  # VFIO_ACCESS or ACCEL_ACCESS: how a runtime reaches it
    functions: tuple[ChipFunction, ...]
    expected_functions: int  # how many functions a whole chip of this kind has

    @property
    def nodes(self) -> tuple[str, ...]:
        """The chip's own nodes: each function's /dev/vfio/<group> (deduplicated: functions may
        share a group) or its /dev/accelN; without /dev/vfio/vfio, which every VFIO chip shares."""
        found: list[str] = []
        for fn in self.functions:
            wanted = (group_node(fn.group),) if self.access == VFIO_ACCESS and fn.group else fn.accel
            found += [node for node in wanted if node not in found]
        return tuple(found)

    @property
    def uses_vfio(self) -> bool:
        """True when a runtime reaches this chip through VFIO (and so needs /dev/vfio/vfio too)."""
        return self.access == VFIO_ACCESS

    @property
    def complete(self) -> bool:
        """Every function of the chip is present (a missing one: a half-visible chip)."""
        return len(self.functions) >= self.expected_functions


def group_chips(functions: Iterable[ChipFunction], table: DeviceTable) -> list[Chip]:
    """Functions grouped by base address into chips, numbered in base-address order."""
    by_base: dict[str, list[ChipFunction]] = {}
    for fn in functions:
        by_base.setdefault(base_address(fn.address), []).append(fn)
    chips = []
    for index, base in enumerate(sorted(by_base)):
        members = tuple(sorted(by_base[base], key=lambda fn: fn.address))
        kind = table.named(members[0].kind)
        access = kind.access if kind is not None else VFIO_ACCESS  # configured stand-ins: bound to vfio-pci
        expected = kind.chip_functions if kind is not None else 1
        chips.append(Chip(index, base, members[0].kind, access, members, expected))
    return chips


def chips_present(root: Root, table: DeviceTable, tpus: Sequence[SurveyedFunction]) -> list[Chip]:
    """The chips of a survey (:func:`tpuboot.devices.survey.survey`): every function of the table,
    with its group only while bound to vfio-pci, and accel nodes for accel-driver chips."""
    functions = []
    for t in tpus:
        kind = table.named(t.kind)
        accel = accel_nodes(root, t.address) if kind is not None and kind.access == ACCEL_ACCESS else ()
        group = t.iommu_group if t.driver == VFIO_PCI else None
        functions.append(ChipFunction(t.address, t.kind, group, accel))
    return group_chips(functions, table)
