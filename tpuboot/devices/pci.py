"""PCI addresses and what sysfs says about one PCI function."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tpuboot.devices.table import DeviceTable, Kind, PciIds
from tpuboot.errors import UsageError
from tpuboot.numbers import ascii_hex
from tpuboot.paths import Root

PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
IOMMU_GROUPS = "/sys/kernel/iommu_groups"
#: A function's ``uevent`` is a few short lines; more is not the kernel's and is not read.
UEVENT_MOST = 4096

# domain:bus:device.function; device is 5 bits (00-1f), function 3 bits (0-7).
_BUS_DEVICE = r"(?P<bus>[0-9a-f]{2}):(?P<dev>[01][0-9a-f])"
_BUS_DEVICE_FUNCTION = rf"{_BUS_DEVICE}\.(?P<fn>[0-7])"
#: The domain as sysfs names it: 4 digits or more (a VMD domain has 5), at most 8 (it is 32 bits).
_SYSFS_DOMAIN = r"[0-9a-f]{4,8}"
#: What a user may write: the domain is optional (0000), and has its usual 4 digits.
_DBDF = re.compile(rf"(?:(?P<domain>[0-9a-f]{{4}}):)?{_BUS_DEVICE_FUNCTION}")
#: What sysfs names a function.
_FUNCTION_NAME = re.compile(rf"{_SYSFS_DOMAIN}:{_BUS_DEVICE_FUNCTION}")
#: A chip's base address: its functions' name without the function (``dddd:bb:dd``).
_CHIP_ADDRESS = re.compile(rf"{_SYSFS_DOMAIN}:{_BUS_DEVICE}")


def is_function_name(name: str) -> bool:
    """Whether ``name`` (an entry of /sys/bus/pci/devices, or of a bridge's directory) is a PCI function."""
    return _FUNCTION_NAME.fullmatch(name) is not None


def is_chip_address(text: str) -> bool:
    """Whether ``text`` is a chip's base address as :func:`tpuboot.devices.chips.base_address`
    gives it of a function's sysfs name (what the reset breaker's record is keyed by)."""
    return _CHIP_ADDRESS.fullmatch(text) is not None


def parse_dbdf(text: str) -> str:
    """Validate a PCI address strictly and return it as ``dddd:bb:dd.f`` (lower case)."""
    match = _DBDF.fullmatch(text.strip().lower())
    if not match:
        raise UsageError(
            f"{text!r} is not a PCI address; write it as dddd:bb:dd.f (e.g. 0000:00:04.0) or bb:dd.f"
        )
    domain = match["domain"] or "0000"
    return f"{domain}:{match['bus']}:{match['dev']}.{match['fn']}"


def list_addresses(root: Root) -> list[str]:
    """Every PCI function the kernel knows, in address order."""
    try:
        return sorted(os.listdir(root.path(PCI_DEVICES)))
    except FileNotFoundError:
        return []


def _id_pair(text: str) -> tuple[int, int]:
    """``1AE0:0062`` (the kernel's PCI_ID and PCI_SUBSYS_ID form) as two ints; ValueError if not."""
    first, colon, second = text.partition(":")
    pair = (ascii_hex(first), ascii_hex(second))
    if not colon or pair[0] is None or pair[1] is None:
        raise ValueError(text)
    return pair[0], pair[1]


def _link_name(path: Path) -> str | None:
    """The last component of a symlink's target, or None when there is no link."""
    try:
        return os.path.basename(os.readlink(path))
    except (FileNotFoundError, NotADirectoryError):
        return None


class PciFunction:
    """One PCI function as sysfs shows it; every read goes to sysfs (never cached)."""

    def __init__(self, root: Root, address: str) -> None:
        self.root = root
        self.address = address
        self.path = root.path(f"{PCI_DEVICES}/{address}")

    def exists(self) -> bool:
        return self.path.is_dir()

    def ids(self) -> PciIds:
        """Vendor, device and subsystem ids from one read of ``uevent`` (not four attribute files:
        coldplug classifies every function on the bus before the first bind can start)."""
        try:
            with open(self.path / "uevent", encoding="ascii", errors="replace") as f:
                fields = dict(line.partition("=")[::2] for line in f.read(UEVENT_MOST).splitlines())
            vendor, device = _id_pair(fields["PCI_ID"])
        except (FileNotFoundError, NotADirectoryError, KeyError, ValueError):
            raise FileNotFoundError(f"{self.address}: no PCI ids in sysfs") from None
        try:
            return PciIds(vendor, device, *_id_pair(fields.get("PCI_SUBSYS_ID", "")))
        except ValueError:
            return PciIds(vendor, device)

    def driver(self) -> str | None:
        """The bound driver's name, re-read from the ``driver`` link every time."""
        return _link_name(self.path / "driver")

    def iommu_group(self) -> str | None:
        return _link_name(self.path / "iommu_group")

    def driver_override(self) -> str | None:
        try:
            text = (self.path / "driver_override").read_text(errors="replace").strip()
        except FileNotFoundError:
            return None
        return None if text in ("", "(null)") else text


def tpu_functions(root: Root, table: DeviceTable) -> list[tuple[PciFunction, Kind]]:
    """Each function present that ``table`` calls a TPU (of any kind), with its kind, in address
    order. One removed while looked at, or whose ids cannot be read, is left out: nothing here
    vouches for it (`status`'s survey reports such a function as maybe a TPU)."""
    found = []
    for address in list_addresses(root):
        fn = PciFunction(root, address)
        try:
            kind = table.classify(fn.ids())
        except OSError:
            continue
        if kind is not None:
            found.append((fn, kind))
    return found


def group_members(root: Root, group: str) -> list[str]:
    """The PCI addresses sharing IOMMU group ``group``."""
    try:
        return sorted(os.listdir(root.path(f"{IOMMU_GROUPS}/{group}/devices")))
    except FileNotFoundError:
        return []
