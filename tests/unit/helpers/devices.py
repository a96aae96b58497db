"""TPU functions on the fake kernel: their IDs, adding them, and the binder and survey over them.

One place for the IDs the device, daemon, CDI, doctor and holder tests put on the fake kernel.
"""

from __future__ import annotations

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.config import VfioConfig
from tpuboot.devices.survey import survey
from tpuboot.devices.table import GOOGLE, DeviceTable
from tpuboot.devices.vfio import Binder

V4 = (GOOGLE, 0x005E, (0, 0))
V5P = (GOOGLE, 0x0062, (GOOGLE, 0x00AD))
TPU7X = (GOOGLE, 0x0076, (GOOGLE, 0x00F2))


def binder(kernel: FakeKernel, machine: str = "x86_64", rules=(), **vfio) -> Binder:
    config = VfioConfig(**{"node_timeout": 0.05, **vfio})
    return Binder(
        kernel.root,
        DeviceTable(rules),
        config,
        write=kernel.write,
        load_module=kernel.load_module,
        machine=machine,
    )


def add_tpu(kernel: FakeKernel, address="0000:00:04.0", ids=V5P, driver=None, group="4"):
    vendor, device, subsystem = ids
    kernel.add_device(address, vendor, device, subsystem, driver=driver, group=group)


def four_tpus_and_a_disk(kernel: FakeKernel) -> FakeKernel:
    """The daemon tests' host: four unbound v5p functions, each in its own group, and a virtio
    disk (not a TPU: never touched)."""
    for i in range(4):
        add_tpu(kernel, f"0000:00:0{4 + i}.0", V5P, driver=None, group=str(4 + i))
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    return kernel


def surveyed(kernel: FakeKernel, table: DeviceTable) -> list:
    return survey(Binder(kernel.root, table, VfioConfig(node_timeout=0.05), write=kernel.write))


def add(
    kernel: FakeKernel, address: str, ids: tuple, group: str | None, driver: str | None = "vfio-pci"
) -> None:
    vendor, device, subsystem = ids
    kernel.add_device(address, vendor, device, subsystem, driver=driver, group=group)


def add_chips(kernel: FakeKernel, groups: list[str], ids: tuple = V5P, per_chip: int = 1) -> None:
    """``groups`` bound to vfio-pci, ``per_chip`` functions to a chip, one group each."""
    vendor, device, subsystem = ids
    for n, group in enumerate(groups):
        chip, fn = divmod(n, per_chip)
        address = f"0000:00:{4 + chip:02x}.{fn}"
        kernel.add_device(address, vendor, device, subsystem, driver="vfio-pci", group=group)


#: What a function that fell off the bus answers to config reads (its vendor id 0xffff).
GONE = b"\xff" * 64


def wedge(kernel: FakeKernel, address: str) -> None:
    """The function falls off the bus: its config space reads all ones."""
    kernel.p(f"/sys/bus/pci/devices/{address}/config").write_bytes(GONE)


def unwedge(kernel: FakeKernel, address: str) -> None:
    """The function answers again, as a v5p (Google's vendor id, device 0x0062)."""
    kernel.p(f"/sys/bus/pci/devices/{address}/config").write_bytes(b"\xe0\x1a\x62\x00" + bytes(60))
