"""Every way a process can hold a chip, as a scan of /proc/*/fd meets it.

A VFIO chip is held through its group node (``/dev/vfio/N``), through its VFIO device cdev
(``/dev/vfio/devices/vfioN``, iommufd, Linux 6.6 and later), or through a device fd taken from the
group, which stays open after the group's fd is closed and whose link reads
``anon_inode:[vfio-device]`` (its fdinfo names the device from Linux 6.18 on). A v2 to v4 chip is
held through its ``/dev/accelN``. The VFIO container ``/dev/vfio/vfio`` is shown but decides
nothing: any VFIO user opens it.

On the running host a fd is matched by the device number of what it has open (st_rdev): link
text can be faked by a process in its own mount namespace (a node bind-mounted at any name, a
file named like a node). Under ``--root`` (a tree, not this kernel) only the text exists. A fd of
a VFIO or accel device that cannot be tied to a chip, nor to a device that is no TPU, counts as
"held, chip unknown": never as free.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tpuboot.devices.chips import VFIO_CONTAINER, Chip
from tpuboot.devices.pci import IOMMU_GROUPS, PCI_DEVICES
from tpuboot.devices.vfio import group_node
from tpuboot.kernelfiles import read_text
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root

#: The link text of a VFIO device fd (taken from a group, or a cdev's on some kernels).
VFIO_DEVICE_FD = "anon_inode:[vfio-device]"
#: Where a VFIO device fd's fdinfo names its device (Linux 6.18+).
SYSPATH_FIELD = "vfio-device-syspath:"
VFIO_CDEV_DIR = "/dev/vfio/devices"
#: /proc/devices' names of the VFIO groups' and the VFIO device cdevs' majors.
VFIO_MAJOR_NAMES = ("vfio", "vfio-dev")
VFIO_CLASSES = ("/sys/class/vfio", "/sys/class/vfio-dev")


def device_fd_key(address: str) -> str:
    """What a holder of a chip's VFIO device fd is shown to hold."""
    return f"{VFIO_DEVICE_FD} of {address}"


@dataclass
class Targets:
    """What a scan looks for: a key per chip node (its text under --root, its number on the host),
    and what tells a VFIO or accel fd of another device from one of an unknown chip."""

    by_text: dict[str, str] = field(default_factory=dict)  # link text -> key
    by_number: dict[int, str] = field(default_factory=dict)  # st_rdev -> key (the host only)
    by_address: dict[str, str] = field(default_factory=dict)  # a chip function's address -> key
    majors: set[int] = field(default_factory=set)  # VFIO and the chips' accel majors (the host only)
    others: set[int] = field(default_factory=set)  # numbers of VFIO devices that are no chip's
    other_texts: set[str] = field(default_factory=set)  # their names, for --root trees
    addresses: set[str] = field(default_factory=set)  # every PCI function present (a device fd's)
    chip_keys: dict[str, set[str]] = field(default_factory=dict)  # a chip's base address -> its keys

    def keys_of(self, chip: Chip) -> set[str]:
        """Every key that means ``chip``."""
        return self.chip_keys.get(chip.address, set())


def _dev(root: Root, path: str) -> int | None:
    """A sysfs ``dev`` file's ``major:minor`` as a device number."""
    major, _, minor = (read_text(root, path, 32) or "").strip().partition(":")
    a, b = ascii_int(major), ascii_int(minor)
    return None if a is None or b is None else os.makedev(a, b)


def _listdir(root: Root, path: str) -> list[str]:
    try:
        return sorted(os.listdir(root.path(path)))
    except OSError:
        return []


def _cdevs(root: Root, address: str) -> list[str]:
    """The VFIO device cdevs of one function (``vfioN``), from its sysfs ``vfio-dev`` directory."""
    return [name for name in _listdir(root, f"{PCI_DEVICES}/{address}/vfio-dev") if name.startswith("vfio")]


def _majors(root: Root, names: Iterable[str]) -> set[int]:
    """The character majors /proc/devices gives ``names``."""
    wanted, found, block = set(names), set(), False
    for line in (read_text(root, "/proc/devices") or "").splitlines():
        if line.startswith("Block devices:"):
            block = True
        number, _, name = line.strip().partition(" ")
        major = ascii_int(number)
        if not block and major is not None and name in wanted:
            found.add(major)
    return found


def _chr(path: str) -> int | None:
    """The device number of ``path`` on this host if it is a character device."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) and st.st_rdev else None


def targets(root: Root, chips: Sequence[Chip]) -> Targets:
    """The keys of ``chips``' nodes, cdevs and device fds, and the other VFIO devices present."""
    t = Targets()
    for chip in chips:
        keys = t.chip_keys.setdefault(chip.address, set(chip.nodes))
        for fn in chip.functions:
            t.by_address[fn.address] = device_fd_key(fn.address)
            keys.add(device_fd_key(fn.address))
            keys.update(f"{VFIO_CDEV_DIR}/{cdev}" for cdev in _cdevs(root, fn.address))
        t.by_text.update((key, key) for key in keys if key.startswith("/dev/"))
    t.by_text[VFIO_CONTAINER] = VFIO_CONTAINER
    t.addresses = set(_listdir(root, PCI_DEVICES))
    _other_vfio(root, t)
    if root.is_host:
        _numbers(root, chips, t)
    return t


def _other_vfio(root: Root, t: Targets) -> None:
    """The VFIO groups and cdevs present whose devices are all no chip's: a fd of one is not a
    chip's (another VFIO user: a VM's passed-through NIC)."""
    for name in _listdir(root, IOMMU_GROUPS):
        members = _listdir(root, f"{IOMMU_GROUPS}/{name}/devices")
        if members and not any(m in t.by_address for m in members):
            t.other_texts.add(group_node(name))
            number = _dev(root, f"/sys/class/vfio/{name}/dev")
            if number is not None:
                t.others.add(number)
    for address in t.addresses - set(t.by_address):
        for cdev in _cdevs(root, address):
            t.other_texts.add(f"{VFIO_CDEV_DIR}/{cdev}")
            number = _dev(root, f"{PCI_DEVICES}/{address}/vfio-dev/{cdev}/dev")
            if number is not None:
                t.others.add(number)


def _numbers(root: Root, chips: Sequence[Chip], t: Targets) -> None:
    """The host's device numbers of each key, and the majors whose unmatched fds are unknown."""
    t.majors = _majors(root, VFIO_MAJOR_NAMES)
    for text, key in t.by_text.items():
        number = _chr(text) if not text.startswith(VFIO_CDEV_DIR) else None
        if number is not None:
            t.by_number[number] = key
    for chip in chips:
        for fn in chip.functions:
            for cdev in _cdevs(root, fn.address):
                number = _dev(root, f"{PCI_DEVICES}/{fn.address}/vfio-dev/{cdev}/dev")
                if number is not None:
                    t.by_number[number] = f"{VFIO_CDEV_DIR}/{cdev}"
            t.majors |= {os.major(n) for n in map(_chr, fn.accel) if n is not None}
