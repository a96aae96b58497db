"""How a module is in a kernel, from the evidence each kind of kernel leaves (kmod's order)."""

from __future__ import annotations

import os

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.devices.kmodule import canonical, in_kernel, installed_releases, module_state
from tpuboot.paths import Root


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("vfio-pci", "vfio_pci"),
        ("kernel/drivers/vfio/pci/vfio-pci.ko", "vfio_pci"),
        ("kernel/drivers/vfio/pci/vfio-pci.ko.zst", "vfio_pci"),
        ("updates/dkms/vfio_pci.ko.xz", "vfio_pci"),
        ("vfio_iommu_type1", "vfio_iommu_type1"),
    ],
)
def test_module_names_are_spelled_as_the_kernel_does(name, module):
    assert canonical(name) == module


@pytest.mark.parametrize(
    ("shape", "load", "origin", "evidence"),
    [
        ("builtin", False, "built-in", "/lib/modules/6.8.0-1015-gcp/modules.builtin"),
        ("builtin", True, "built-in", "/lib/modules/6.8.0-1015-gcp/modules.builtin"),
        ("module", False, "loadable", "/lib/modules/6.1.0-28-cloud-amd64/modules.dep"),
        ("module", True, "loaded", "/proc/modules"),
        (
            "none",
            False,
            "absent",
            "neither /lib/modules/6.1.0-28-cloud-amd64/modules.builtin nor modules.dep",
        ),
    ],
)
def test_each_kernel_shape(tmp_path, shape, load, origin, evidence):
    kernel = FakeKernel(tmp_path, shape)
    if load:
        kernel.load_module("vfio-pci")  # on a built-in: modprobe succeeds and nothing changes
    state = module_state(kernel.root, "vfio-pci")
    assert (state.origin, state.release) == (origin, kernel.release)
    assert state.evidence.startswith(evidence)


def test_built_in_without_module_lists_is_told_by_sysfs_alone(tmp_path):
    """An initstate-less /sys/module/<name> is a built-in with parameters (sysfs-module ABI)."""
    kernel = FakeKernel(tmp_path, "builtin")
    for name in ("modules.builtin", "modules.builtin.modinfo", "modules.dep"):
        os.unlink(kernel.p(f"/lib/modules/{kernel.release}/{name}"))
    state = module_state(kernel.root, "vfio_iommu_type1")
    assert (state.origin, state.evidence) == ("built-in", "/sys/module/vfio_iommu_type1 without initstate")


def test_a_loaded_module_is_told_by_initstate_without_proc(tmp_path):
    kernel = FakeKernel(tmp_path, "module")
    kernel.load_module("vfio-pci")
    os.unlink(kernel.p("/proc/modules"))
    assert module_state(kernel.root, "vfio_pci").evidence == "/sys/module/vfio_pci/initstate"


def test_a_module_directory_before_its_initstate_is_a_module_being_loaded(tmp_path):
    """kmod reads this as "coming": a loadable module mid-load, not a built-in."""
    kernel = FakeKernel(tmp_path, "module")
    kernel.p("/sys/module/vfio_pci/parameters").mkdir(parents=True)
    assert module_state(kernel.root, "vfio-pci").origin == "loaded"


def test_an_image_tree_without_proc_has_no_running_kernel(tmp_path):
    write = tmp_path / "lib/modules/6.8.0-1015-gcp"
    write.mkdir(parents=True)
    (write / "modules.builtin").write_text("kernel/drivers/vfio/pci/vfio-pci.ko\n")
    root = Root(tmp_path)
    state = module_state(root, "vfio-pci")
    assert (state.origin, state.release, state.kernel) == ("unknown", None, "this kernel")
    assert installed_releases(root) == ["6.8.0-1015-gcp"]
    assert in_kernel(root, "6.8.0-1015-gcp", "vfio-pci").origin == "built-in"
