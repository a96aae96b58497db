"""A kernel booted without its IOMMU: tpuboot says what is wrong and how to fix it, and lives on.

Nothing may be unbound on the way: a device left without a driver and without vfio is worse
than one left on its host driver.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.vm.tpuboot_guest import VIRTIO_RNG
from tpuboot.devices.vfio import IOMMU_OFF_FIX

from .conftest import VMFactory

pytestmark = pytest.mark.vm

FIX = f"no IOMMU group, the IOMMU is off; {IOMMU_OFF_FIX}"


def test_no_iommu_gives_the_fix_and_keeps_drivers(vm_factory: VMFactory, tpuboot_image: Path) -> None:
    vm = vm_factory(tpuboot_image, iommu=False, devices=["edu", "virtio-rng-pci"])
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    status = vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"], check=True).stdout.strip()
    assert status.startswith("0 of 2 TPUs bound to vfio-pci; 0000:")
    assert FIX in status
    assert FIX in vm.journal("tpuboot")
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    assert rng.driver == "virtio-pci"  # checked before unbinding: still on its own driver
    result = vm.run(["tpuboot", "bind", rng.address])
    assert result.rc == 1
    assert result.stderr.strip() == f"tpuboot: {rng.address}: {FIX}"
