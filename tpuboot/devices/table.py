"""The TPU table: which PCI devices are TPUs, which generation, and which tpuboot binds; and for
each generation, how its accelerator types count, its machine types and its slice shapes.

Data, not code: built-in generations come from public sources (doc/configuration.md names
them), and the configuration file adds match rules without a new release.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from tpuboot.config import MatchRule

GOOGLE = 0x1AE0


@dataclass(frozen=True)
class PciIds:
    """The identity a PCI function reports in sysfs."""

    vendor: int
    device: int
    subsystem_vendor: int | None = None
    subsystem_device: int | None = None

    def __str__(self) -> str:
        text = f"{self.vendor:04x}:{self.device:04x}"
        if self.subsystem_vendor is not None and self.subsystem_device is not None:
            text += f" (subsystem {self.subsystem_vendor:04x}:{self.subsystem_device:04x})"
        return text


# How a runtime reaches a chip: libtpu opens /dev/vfio/<group> (with /dev/vfio/vfio) for v5e and
# later, the accel driver's /dev/accelN for v2 to v4 (tpu-info's chip_path, GKE's TPU device plugin).
Access = Literal["vfio", "accel"]
VFIO_ACCESS: Access = "vfio"
ACCEL_ACCESS: Access = "accel"


@dataclass(frozen=True, repr=False)
class Kind:
    """One entry of the table. ``vfio`` says whether tpuboot binds it to vfio-pci; ``access`` how a
    runtime opens the chip; ``chip_functions`` how many PCI functions one chip is (2 for v2, v3 and
    TPU7x, as tpu-info counts them; they share a base address)."""

    name: str
    vendor: int
    device: int
    subsystem_vendor: int | None = None
    subsystem_device: int | None = None
    vfio: bool = False
    generations: tuple[str, ...] = ()  # keys of GENERATIONS this device can be (none: unknown)
    access: Access = VFIO_ACCESS
    chip_functions: int = 1

    def __repr__(self) -> str:
        return f"Kind({self.name!r})"

    def matches(self, ids: PciIds) -> bool:
        if (ids.vendor, ids.device) != (self.vendor, self.device):
            return False
        if self.subsystem_vendor is None:
            return True
        return (ids.subsystem_vendor, ids.subsystem_device) == (self.subsystem_vendor, self.subsystem_device)


# Generations whose runtime reaches the chip through vfio-pci: tpuboot binds these. v5e is
# reached through /dev/vfio like v5p and v6e (tpu-info's chip_path, GKE's TPU device plugin); its
# subsystem id is not public, so every 0x0063 function is taken for one.
VFIO_KINDS = (
    Kind("TPU v5e", GOOGLE, 0x0063, vfio=True, generations=("v5e",)),
    Kind("TPU v5p", GOOGLE, 0x0062, GOOGLE, 0x00AD, vfio=True, generations=("v5p",)),
    Kind("TPU v6e", GOOGLE, 0x006F, GOOGLE, 0x00D1, vfio=True, generations=("v6e",)),
    Kind("TPU7x", GOOGLE, 0x0076, GOOGLE, 0x00F2, vfio=True, generations=("tpu7x",), chip_functions=2),
)

# Known for reporting only: older generations use the accel driver; newer ones are undocumented.
REPORT_KINDS = (
    Kind("TPU v2/v3", GOOGLE, 0x0027, generations=("v2", "v3"), access=ACCEL_ACCESS, chip_functions=2),
    Kind("TPU (unnamed 0x0056)", GOOGLE, 0x0056),
    Kind("TPU v4", GOOGLE, 0x005E, generations=("v4",), access=ACCEL_ACCESS),
    Kind("TPU v5p (unexpected subsystem)", GOOGLE, 0x0062, generations=("v5p",)),
    Kind("TPU v6e (unexpected subsystem)", GOOGLE, 0x006F, generations=("v6e",)),
    Kind("TPU7x (unexpected subsystem)", GOOGLE, 0x0076, generations=("tpu7x",), chip_functions=2),
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

    def named(self, name: str) -> Kind | None:
        """The kind called ``name`` (what a survey or the device manager records of a function)."""
        return next((kind for kind in self.kinds if kind.name == name), None)


@dataclass(frozen=True, repr=False)
class Generation:
    """One TPU generation, as its accelerator types (``v5p-1024``), machine types and slices are.

    ``per_chip``: what the number in an accelerator type counts, per chip (2: TensorCores, for
    v2 to v5p and TPU7x; 1: chips, for v5e and v6e). ``host_chips``: chips per host in a
    multi-host slice. ``host_max``: the largest slice one host holds. ``machine_types``: chips per
    VM of each. ``dims``: topology dimensions (2: AxB, 3: AxBxC). ``shapes``: the valid 2D
    topologies, or () where a rule decides (3D: every side at most 4, or every side a multiple of
    4). ``max_chips``: the pod's size. ``kind``: the name :data:`VFIO_KINDS`/:data:`REPORT_KINDS`
    give its chips.
    """

    key: str
    kind: str
    prefixes: tuple[str, ...]
    per_chip: int
    dims: int
    host_max: int
    machine_types: dict[str, int] = field(hash=False)
    shapes: tuple[str, ...]
    max_chips: int
    host_chips: int = 4

    def __repr__(self) -> str:
        return f"Generation({self.key!r})"


_SHAPES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

#: Every generation tpuboot knows, from public sources: GKE's TPU page (machine types, chips per VM,
#: v5e topologies and VMs per slice), Cloud TPU's v4, v5p, v6e and
#: TPU7x pages (TensorCores per chip, pod sizes, v6e's ct6e-standard-* and 3D topology rules), and
#: GKE's Ironwood page (4 chips per tpu7x-standard-4t VM). The number in an accelerator type
#: counts TensorCores for v2 to v5p and TPU7x (v5p-8 and tpu7x-8 are 4 chips), chips for v5e/v6e.
GENERATIONS = (
    Generation("v2", "TPU v2/v3", ("v2",), 2, 2, 4, {}, (), 256),
    Generation("v3", "TPU v2/v3", ("v3",), 2, 2, 4, {}, (), 1024),
    Generation("v4", "TPU v4", ("v4",), 2, 3, 4, {"ct4p-hightpu-4t": 4}, (), 4096),
    Generation(
        "v5e",
        "TPU v5e",
        ("v5litepod", "v5e"),
        1,
        2,
        8,
        {"ct5lp-hightpu-1t": 1, "ct5lp-hightpu-4t": 4, "ct5lp-hightpu-8t": 8},
        _SHAPES_2D,
        256,
    ),
    Generation("v5p", "TPU v5p", ("v5p",), 2, 3, 4, {"ct5p-hightpu-4t": 4}, (), 8960),
    Generation(
        "v6e",
        "TPU v6e",
        ("v6e",),
        1,
        2,
        8,
        {"ct6e-standard-1t": 1, "ct6e-standard-4t": 4, "ct6e-standard-8t": 8},
        _SHAPES_2D,
        256,
    ),
    Generation(
        "tpu7x", "TPU7x", ("tpu7x",), 2, 3, 4, {"tpu7x-standard-1t": 1, "tpu7x-standard-4t": 4}, (), 9216
    ),
)


def generation_named(prefix: str) -> Generation | None:
    """The generation whose accelerator types start ``prefix-`` (``v5litepod``, ``tpu7x``)."""
    return next((g for g in GENERATIONS if prefix.lower() in g.prefixes), None)


def generation_of_machine(machine_type: str) -> tuple[Generation, int] | None:
    """(generation, chips per VM) of a TPU machine type, None for any other machine type."""
    found = (g for g in GENERATIONS if machine_type in g.machine_types)
    return next(((g, g.machine_types[machine_type]) for g in found), None)


def generations_of_kind(name: str) -> tuple[str, ...]:
    """The generations a built-in kind named ``name`` can be; () for a configured or unknown one."""
    return next((k.generations for k in (*VFIO_KINDS, *REPORT_KINDS) if k.name == name), ())
