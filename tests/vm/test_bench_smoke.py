"""The bench proves itself: real kernel, IOMMU groups, a by-hand vfio-pci bind
used without root, and PCI hotplug through QMP.

tpuboot's scenario tests build on exactly these steps; if this module fails,
look at the bench before looking at tpuboot. It lives here, not with the pure tests of the bench
and the harness (tests/unit/bench/, tests/unit/harness/), because it boots guests from this
folder's fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import GUEST_LIBEXEC, TESTER, Artifacts, in_tree, install_debs
from harness.vm.hostenv import run
from harness.vm.machine import VM, PciDevice

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

EDU = (0x1234, 0x11E8)  # QEMU's educational device: the stand-in for a TPU
VIRTIO_RNG = (0x1AF4, 0x1005)
EDU_ID_REGISTER = "0x010000ed"  # BAR0 offset 0 of the edu device
VFIO_READ = f"{GUEST_LIBEXEC}/vfio_read.py"


PROBE_PACKAGE = "tpuboot-bench-probe"
HOOK_MARKER = "/etc/tpuboot-bench/installed-by-hook"


def _probe_deb(folder: Path) -> Path:
    """A tiny .deb built here (no registry): proves install hooks can dpkg -i."""
    root = folder / PROBE_PACKAGE
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {PROBE_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: tpuboot test bench <bench@localhost>\nDescription: bench smoke-test package\n"
    )
    (root / "usr/share" / PROBE_PACKAGE).mkdir(parents=True)
    (root / "usr/share" / PROBE_PACKAGE / "README").write_text("installed by dpkg in an install hook\n")
    deb = folder / f"{PROBE_PACKAGE}.deb"
    run(["dpkg-deb", "--root-owner-group", "--build", root, deb], timeout=60)
    return deb


@pytest.fixture(scope="module")
def smoke_image(vm_image_factory: ImageFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    deb = _probe_deb(tmp_path_factory.mktemp("probe-deb"))

    def install(tree: Path) -> None:
        marker = in_tree(tree, HOOK_MARKER)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("yes\n")
        install_debs(tree, [deb])

    return vm_image_factory(install, key="bench-smoke")


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, smoke_image: Path) -> Iterator[VM]:
    """One guest for the whole module: 2 edu, 1 virtio-rng, 2 empty hotplug ports."""
    with VM.from_artifacts(
        vm_artifacts,
        smoke_image,
        devices=["edu", "edu", "virtio-rng-pci"],
        hotplug_ports=2,
        name="bench-smoke",
    ) as machine:
        machine.wait_booted()
        yield machine


def _one(devs: list[PciDevice]) -> PciDevice:
    assert len(devs) == 1, devs
    return devs[0]


def test_boots_debian_kernel_cleanly(vm: VM, vm_artifacts: Artifacts) -> None:
    assert vm.boot_status is not None
    assert vm.boot_status.state == "running", f"failed units: {vm.boot_status.failed_units}"
    assert vm.run(["uname", "-r"], check=True).stdout.strip() == vm_artifacts.kernel.release
    assert "intel_iommu=on" in vm.read_file("/proc/cmdline").decode()
    assert vm.run(["id", "-u"], user=TESTER, check=True).stdout.strip() == "1000"


def test_install_hook_ran(vm: VM) -> None:
    assert vm.read_file(HOOK_MARKER) == b"yes\n"
    status = vm.run(["dpkg-query", "-W", "-f=${Status}", PROBE_PACKAGE], check=True).stdout
    assert status == "install ok installed"


def test_guestcmd_is_binary_safe(vm: VM) -> None:
    blob = bytes(range(256)) * 64 + b"\n\r\x00no newline at end"
    result = vm.run(["cat"], stdin=blob, check=True)
    assert result.stdout_bytes == blob
    failed = vm.run("echo out; echo err >&2; exit 3")
    assert (failed.rc, failed.stdout, failed.stderr) == (3, "out\n", "err\n")
    slow = vm.run(["sleep", "30"], timeout=1)
    assert slow.timed_out and not slow.ok


def test_devices_visible_with_own_iommu_groups(vm: VM) -> None:
    devs = vm.pci_devices()
    edus = [d for d in devs if (d.vendor, d.device) == EDU]
    assert len(edus) == 2, devs
    assert all(d.driver is None for d in edus), edus
    rng = _one([d for d in devs if (d.vendor, d.device) == VIRTIO_RNG])
    assert rng.driver == "virtio-pci"
    groups = [d.iommu_group for d in [*edus, rng]]
    assert None not in groups and len(set(groups)) == 3, devs


@pytest.fixture
def edus(vm: VM) -> Iterator[tuple[PciDevice, PciDevice]]:
    """The two edu devices; afterwards none is bound to a driver, as the boot left them (and as
    test_devices_visible_with_own_iommu_groups expects)."""
    first, second = vm.pci_devices(*EDU)
    yield first, second
    for edu in (first, second):
        sysfs = f"/sys/bus/pci/devices/{edu.address}"
        unbind = f"[ ! -e {sysfs}/driver ] || echo {edu.address} > {sysfs}/driver/unbind"
        vm.run(f"echo > {sysfs}/driver_override; {unbind}", check=True)


def test_vfio_bind_by_hand_then_unprivileged_bar0_read(vm: VM, edus: tuple[PciDevice, PciDevice]) -> None:
    edu, other = edus
    disk_before = [d for d in vm.pci_devices() if d.driver == "virtio-pci"]
    sysfs = f"/sys/bus/pci/devices/{edu.address}"
    vm.run(["modprobe", "vfio-pci"], check=True)
    vm.run(
        f"echo vfio-pci > {sysfs}/driver_override && echo {edu.address} > /sys/bus/pci/drivers_probe",
        check=True,
    )
    driver = vm.run(["readlink", f"{sysfs}/driver"], check=True).stdout.strip()
    assert driver.endswith("/vfio-pci"), driver
    node = f"/dev/vfio/{edu.iommu_group}"
    vm.wait_until(f"[ -c {node} ]", timeout=10)
    vm.run(["chmod", "0666", node], check=True)

    result = vm.run([VFIO_READ, edu.address], user=TESTER, check=True)
    assert result.stdout.strip() == EDU_ID_REGISTER

    # The unbound edu has no group node: the script names the failing step in one line.
    refused = vm.run([VFIO_READ, other.address], user=TESTER)
    assert refused.rc == 1 and refused.stderr.count("\n") == 1, refused.describe()
    assert f"open /dev/vfio/{other.iommu_group} failed: ENOENT" in refused.stderr

    # Nothing else changed driver: the root disk and the rng stay on virtio-pci.
    assert [d for d in vm.pci_devices() if d.driver == "virtio-pci"] == disk_before


def test_hotplug_add_and_remove(vm: VM) -> None:
    count = "[ $(grep -l 0x11e8 /sys/bus/pci/devices/*/device | wc -l) -eq {} ]"
    before = {d.address for d in vm.pci_devices(*EDU)}
    vm.device_add("edu", id="hot-edu", bus=vm.hotplug_ports[0])
    vm.wait_until(count.format(len(before) + 1), timeout=10)
    added = _one([d for d in vm.pci_devices(*EDU) if d.address not in before])
    assert added.iommu_group is not None

    vm.device_del("hot-edu", timeout=30)
    vm.wait_until(count.format(len(before)), timeout=10)
    assert {d.address for d in vm.pci_devices(*EDU)} == before
