"""The device table: which PCI devices are TPUs, which generation, and which tpuboot binds.

Data, not code: built-in generations come from public sources (see the README), and
the configuration file adds match rules without a new release.
"""

from __future__ import annotations

from collections.abc import Iterable

from tpuboot.config import MatchRule

GOOGLE = 0x1AE0


# Plain slotted classes, not NamedTuple or dataclass: those compile code for each class at
# import time, and `tpuboot bind` pays every millisecond of import twenty times over on a slow CPU.


class PciIds:
    """The identity a PCI function reports in sysfs."""

    __slots__ = ("device", "subsystem_device", "subsystem_vendor", "vendor")

    def __init__(
        self,
        vendor: int,
        device: int,
        subsystem_vendor: int | None = None,
        subsystem_device: int | None = None,
    ) -> None:
        self.vendor = vendor
        self.device = device
        self.subsystem_vendor = subsystem_vendor
        self.subsystem_device = subsystem_device

    def __str__(self) -> str:
        text = f"{self.vendor:04x}:{self.device:04x}"
        if self.subsystem_vendor is not None and self.subsystem_device is not None:
            text += f" (subsystem {self.subsystem_vendor:04x}:{self.subsystem_device:04x})"
        return text


class Kind:
    """One entry of the table. ``vfio`` says whether tpuboot binds it to vfio-pci."""

    __slots__ = ("device", "name", "subsystem_device", "subsystem_vendor", "vendor", "vfio")

    def __init__(
        self,
        name: str,
        vendor: int,
        device: int,
        subsystem_vendor: int | None = None,
        subsystem_device: int | None = None,
        vfio: bool = False,
    ) -> None:
        self.name = name
        self.vendor = vendor
        self.device = device
        self.subsystem_vendor = subsystem_vendor
        self.subsystem_device = subsystem_device
        self.vfio = vfio

    def __repr__(self) -> str:
        return f"Kind({self.name!r})"

    def matches(self, ids: PciIds) -> bool:
        if (ids.vendor, ids.device) != (self.vendor, self.device):
            return False
        if self.subsystem_vendor is None:
            return True
        return (ids.subsystem_vendor, ids.subsystem_device) == (self.subsystem_vendor, self.subsystem_device)


# Generations whose runtime reaches the chip through vfio-pci: tpuboot binds these.
VFIO_KINDS = (
    Kind("TPU v5p", GOOGLE, 0x0062, GOOGLE, 0x00AD, vfio=True),
    Kind("TPU v6e", GOOGLE, 0x006F, GOOGLE, 0x00D1, vfio=True),
    Kind("TPU7x", GOOGLE, 0x0076, GOOGLE, 0x00F2, vfio=True),
)

# Known for reporting only: older generations use the accel driver; newer ones are undocumented.
REPORT_KINDS = (
    Kind("TPU v2/v3", GOOGLE, 0x0027),
    Kind("TPU (unnamed 0x0056)", GOOGLE, 0x0056),
    Kind("TPU v4", GOOGLE, 0x005E),
    Kind("TPU v5e", GOOGLE, 0x0063),
    Kind("TPU v5p (unexpected subsystem)", GOOGLE, 0x0062),
    Kind("TPU v6e (unexpected subsystem)", GOOGLE, 0x006F),
    Kind("TPU7x (unexpected subsystem)", GOOGLE, 0x0076),
    Kind("TPU8t", GOOGLE, 0x007C),
    Kind("TPU8i", GOOGLE, 0x0083),
)


def kind_from_rule(rule: MatchRule) -> Kind:
    name = rule.name or f"configured {rule.vendor:04x}:{rule.device:04x}"
    return Kind(name, rule.vendor, rule.device, rule.subsystem_vendor, rule.subsystem_device, vfio=True)


class DeviceTable:
    """Classifies PCI ids; configured rules outrank the report-only built-ins."""

    def __init__(self, extra_rules: Iterable[MatchRule] = ()) -> None:
        self.kinds = (*VFIO_KINDS, *(kind_from_rule(r) for r in extra_rules), *REPORT_KINDS)

    def classify(self, ids: PciIds) -> Kind | None:
        """The first matching kind, or None for a device that is not a TPU."""
        return next((kind for kind in self.kinds if kind.matches(ids)), None)
