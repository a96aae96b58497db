"""The bind sequence against a temporary sysfs tree (the kernel's part played by FakeKernel)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import add_tpu, binder
from tpuboot.config import MatchRule
from tpuboot.devices.vfio import UNSAFE_INTERRUPTS, VFIO_PCI_DRIVER, group_node, vfio_pci_registered
from tpuboot.errors import DeviceError, IommuOffError, TransientDeviceError

V6E = (0x1AE0, 0x006F, (0x1AE0, 0x00D1))
EDU = (0x1234, 0x11E8)


@pytest.fixture
def kernel(tmp_path):
    return FakeKernel(tmp_path)


def node_mode(kernel: FakeKernel, group: str) -> int:
    return os.stat(kernel.p(f"/dev/vfio/{group}")).st_mode & 0o777


def test_bind_from_other_driver_writes_override_unbind_probe_in_order(kernel):
    kernel.add_driver("vfio-pci")
    add_tpu(kernel, driver="virtio-pci")
    result = binder(kernel).bind("0000:00:04.0")
    sequence = [w for w in kernel.writes if not w[0].startswith("/sys/module")]
    assert sequence == [
        ("/sys/bus/pci/devices/0000:00:04.0/driver_override", "vfio-pci"),
        ("/sys/bus/pci/devices/0000:00:04.0/driver/unbind", "0000:00:04.0"),
        ("/sys/bus/pci/drivers_probe", "0000:00:04.0"),
    ]
    assert kernel.driver("0000:00:04.0") == "vfio-pci"
    assert (result.group, result.node, result.changed, result.kind) == ("4", "/dev/vfio/4", True, "TPU v5p")
    assert node_mode(kernel, "4") == 0o666


def test_bind_loads_vfio_pci_when_missing(kernel):
    add_tpu(kernel)
    binder(kernel).bind("0000:00:04.0")
    assert kernel.modules[0] == "vfio-pci"
    assert kernel.driver("0000:00:04.0") == "vfio-pci"


def test_bind_enables_unsafe_interrupts_on_x86_only(kernel, tmp_path):
    add_tpu(kernel)
    binder(kernel).bind("0000:00:04.0")
    assert kernel.p(UNSAFE_INTERRUPTS).read_text() == "Y\n"

    other = FakeKernel(tmp_path / "arm")
    add_tpu(other)
    binder(other, machine="aarch64").bind("0000:00:04.0")
    assert other.p(UNSAFE_INTERRUPTS).read_text() == "N\n"


def test_unsafe_interrupts_can_be_turned_off(kernel):
    add_tpu(kernel)
    binder(kernel, allow_unsafe_interrupts="false").bind("0000:00:04.0")
    assert not any(path.startswith("/sys/module") for path, _ in kernel.writes)


def test_already_bound_device_is_not_reprobed_but_its_node_is_fixed(kernel):
    kernel.add_driver("vfio-pci")
    add_tpu(kernel, driver="vfio-pci")
    kernel.p("/sys/bus/pci/devices/0000:00:04.0/driver_override").write_text("vfio-pci\n")
    assert node_mode(kernel, "4") == 0o600
    result = binder(kernel, allow_unsafe_interrupts="false").bind("0000:00:04.0")
    assert result.changed is False
    assert kernel.writes == []
    assert node_mode(kernel, "4") == 0o666


def test_bind_twice_is_idempotent(kernel):
    add_tpu(kernel, driver="virtio-pci")
    b = binder(kernel)
    assert b.bind("0000:00:04.0").changed is True
    before = list(kernel.writes)
    assert b.bind("0000:00:04.0").changed is False
    assert kernel.writes == before


def test_non_tpu_is_refused_and_left_alone(kernel):
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    with pytest.raises(DeviceError, match=r"not a TPU and is driven by virtio-pci .*boot disk.*--force"):
        binder(kernel).bind("0000:00:02.0")
    assert kernel.writes == []
    assert kernel.driver("0000:00:02.0") == "virtio-pci"


def test_force_binds_a_non_tpu(kernel):
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1005, driver="virtio-pci", group="2")
    assert binder(kernel).bind("0000:00:02.0", force=True).changed
    assert kernel.driver("0000:00:02.0") == "vfio-pci"


def test_v5e_is_bound_to_vfio_pci_as_libtpu_opens_it(kernel):
    """tpu-info's chip_path and GKE's device plugin reach v5e through /dev/vfio, like v5p."""
    add_tpu(kernel, ids=(0x1AE0, 0x0063, (0x1AE0, 0x0000)))
    result = binder(kernel).bind("0000:00:04.0")
    assert (result.kind, kernel.driver("0000:00:04.0")) == ("TPU v5e", "vfio-pci")


def test_report_only_generation_is_refused(kernel):
    kernel.add_device("0000:00:05.0", 0x1AE0, 0x005E, driver="accel", group="5")
    with pytest.raises(DeviceError, match="TPU v4, which tpuboot does not bind"):
        binder(kernel).bind("0000:00:05.0")


def test_known_device_with_unexpected_subsystem_is_not_bound(kernel):
    add_tpu(kernel, ids=(0x1AE0, 0x0062, (0x1AE0, 0x9999)))
    with pytest.raises(DeviceError, match="unexpected subsystem"):
        binder(kernel).bind("0000:00:04.0")


def test_configured_rule_binds_an_extra_device(kernel):
    kernel.add_device("0000:00:06.0", *EDU, group="6")
    rule = MatchRule(vendor=0x1234, device=0x11E8, name="edu")
    assert binder(kernel, rules=[rule]).bind("0000:00:06.0").kind == "edu"


def test_missing_iommu_group_fails_before_unbinding_anything(kernel):
    add_tpu(kernel, driver="virtio-pci", group=None)
    with pytest.raises(IommuOffError, match="IOMMU is off; add intel_iommu=on"):
        binder(kernel).bind("0000:00:04.0")
    assert kernel.writes == []
    assert kernel.driver("0000:00:04.0") == "virtio-pci"


def test_probe_that_binds_nothing_is_reported_not_trusted(kernel):
    kernel.add_driver("vfio-pci")
    add_tpu(kernel, driver="virtio-pci")
    kernel.refuse_probe.add("0000:00:04.0")
    with pytest.raises(TransientDeviceError, match=r"vfio-pci did not take the device .driver is none."):
        binder(kernel).bind("0000:00:04.0")


def test_group_with_a_host_driven_sibling_is_not_viable(kernel):
    add_tpu(kernel, group="7")
    kernel.add_device("0000:00:04.1", 0x8086, 0x1234, driver="e1000e", group="7")
    with pytest.raises(TransientDeviceError, match=r"group 7 is not viable: 0000:00:04.1 \(e1000e\)"):
        binder(kernel).bind("0000:00:04.0")


def test_group_sibling_on_pcieport_is_viable(kernel):
    add_tpu(kernel, group="7")
    kernel.add_device("0000:00:1c.0", 0x8086, 0x2448, driver="pcieport", group="7")
    binder(kernel).bind("0000:00:04.0")


def test_node_that_never_appears_is_a_bounded_transient_error(kernel):
    kernel.create_nodes = False
    add_tpu(kernel)
    with pytest.raises(TransientDeviceError, match=r"/dev/vfio/4 did not appear within 0.05 s"):
        binder(kernel).bind("0000:00:04.0")


def test_configured_node_mode_is_applied(kernel):
    add_tpu(kernel)
    binder(kernel, node_mode=0o660).bind("0000:00:04.0")
    assert node_mode(kernel, "4") == 0o660


def test_missing_device_says_how_to_list_devices(kernel):
    with pytest.raises(DeviceError, match="no such PCI device; `tpuboot status`"):
        binder(kernel).bind("0000:00:09.0")


def test_unbind_returns_device_to_its_default_driver(kernel):
    add_tpu(kernel, driver="virtio-pci")
    b = binder(kernel)
    b.bind("0000:00:04.0")
    assert b.unbind("0000:00:04.0") == "virtio-pci"
    assert kernel.override("0000:00:04.0") == "(null)"
    assert not kernel.p("/dev/vfio/4").exists()


def test_unbind_refuses_a_non_tpu(kernel):
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    with pytest.raises(DeviceError, match="refusing"):
        binder(kernel).unbind("0000:00:02.0")
    assert kernel.writes == []


# --- vfio-pci as Debian (a module) and Ubuntu (built in) build it -------------------------------


@pytest.mark.parametrize("shape", ["module", "builtin"])
def test_bind_on_a_modular_and_a_built_in_vfio_pci(tmp_path, shape):
    """Debian: modprobe loads vfio-pci. Ubuntu: the driver is there from boot, nothing is loaded,
    /proc/modules never lists it, and allow_unsafe_interrupts (built in too) is still set."""
    kernel = FakeKernel(tmp_path, shape)
    add_tpu(kernel, driver="virtio-pci")
    result = binder(kernel).bind("0000:00:04.0")
    assert (kernel.driver("0000:00:04.0"), result.changed) == ("vfio-pci", True)
    assert kernel.p(UNSAFE_INTERRUPTS).read_text() == "Y\n"
    assert [w for w in kernel.writes if w[0].startswith("/sys/module")] == [(UNSAFE_INTERRUPTS, "1")]
    if shape == "builtin":
        assert kernel.modules == []
        assert not any(m.startswith("vfio") for m in kernel.loaded())
    else:
        assert kernel.modules == ["vfio-pci"]
        assert {"vfio_pci", "vfio_iommu_type1"} <= set(kernel.loaded())


@pytest.mark.parametrize("shape", ["module", "builtin"])
def test_a_host_that_cannot_load_modules_binds_only_with_a_built_in_driver(tmp_path, shape):
    """No modprobe (a chroot, a sandbox without CAP_SYS_MODULE): fine when vfio-pci is built in."""

    def refuse(name: str) -> None:
        raise DeviceError(f"{name}: modprobe not allowed here")

    kernel = FakeKernel(tmp_path, shape)
    add_tpu(kernel)
    b = binder(kernel)
    b.load_module = refuse
    if shape == "builtin":
        assert b.bind("0000:00:04.0").changed
    else:
        with pytest.raises(
            DeviceError, match=r"cannot load vfio-pci \(vfio-pci: modprobe not allowed here\)"
        ):
            b.bind("0000:00:04.0")


def test_a_kernel_without_vfio_pci_fails_in_one_line_that_names_the_fix(tmp_path):
    bare = FakeKernel(tmp_path / "bare", "none")
    add_tpu(bare, driver="virtio-pci")
    with pytest.raises(DeviceError) as caught:
        binder(bare).bind("0000:00:04.0")
    message = str(caught.value)
    assert message.startswith(
        "kernel 6.1.0-28-cloud-amd64 has no vfio-pci, neither built in nor as a module; "
        "boot a kernel built with CONFIG_VFIO_PCI"
    )
    assert "\n" not in message
    assert bare.modules == ["vfio-pci"]  # modprobe was still tried: the lists may be stale
    assert bare.writes == [] and bare.driver("0000:00:04.0") == "virtio-pci"


def test_a_missing_unsafe_interrupts_parameter_is_an_error_not_a_removed_device(kernel):
    """A FileNotFoundError would read as "removed during bind" to the daemon."""
    kernel.add_driver("vfio-pci")
    add_tpu(kernel)
    b = binder(kernel)
    b.load_module = lambda name: None
    with pytest.raises(DeviceError, match=r"allow_unsafe_interrupts is missing; set vfio\.allow_unsafe"):
        b.bind("0000:00:04.0")


# --- one source for the group's node and for "vfio-pci is registered" ------------------------------


@pytest.mark.parametrize(("shape", "registered"), [("module", False), ("builtin", True), ("none", False)])
def test_vfio_pci_is_registered_once_built_in_or_loaded(tmp_path, shape, registered):
    kernel = FakeKernel(tmp_path, shape)
    assert vfio_pci_registered(kernel.root) is registered
    if shape == "module":
        kernel.load_module("vfio_pci")
        assert vfio_pci_registered(kernel.root)
        # Registered, though no module list says so: doctor still passes it, by the one test.
        shutil.rmtree(kernel.p("/sys/module/vfio_pci"))
        modules = kernel.p("/proc/modules")
        modules.write_text(
            "".join(line for line in modules.read_text().splitlines(True) if "vfio_pci " not in line)
        )
        from tpuboot.checks.doctor import Doctor
        from tpuboot.config import Config

        (loaded,) = Doctor(kernel.root, Config()).checks.run(kernel.root, ["vfio-pci-loaded"])
        assert loaded.detail == f"the vfio-pci driver is registered ({VFIO_PCI_DRIVER})"


def test_bind_status_and_doctor_name_the_same_group_node(tmp_path):
    from tpuboot.checks.doctor import Doctor
    from tpuboot.config import Config
    from tpuboot.devices.survey import survey

    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, group="12")
    assert binder(kernel).bind("0000:00:04.0").node == group_node("12") == "/dev/vfio/12"
    (tpu,) = survey(binder(kernel))
    assert tpu.node == group_node("12")
    (mode,) = Doctor(kernel.root, Config()).checks.run(kernel.root, ["vfio-node-mode"])
    assert mode.detail == f"{group_node('12')} mode 0666"
    os.unlink(kernel.p(group_node("12")))
    (tpu,) = survey(binder(kernel))
    assert tpu.problem == f"{group_node('12')} is missing"
