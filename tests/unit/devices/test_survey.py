"""`tpuboot status` on a kernel with vfio-pci as a module (Debian), built in (Ubuntu), or absent."""

from __future__ import annotations

import os

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import add_tpu, binder
from tpuboot.devices.survey import driver_summary, survey


def problems(kernel: FakeKernel) -> list[str | None]:
    return [t.problem for t in survey(binder(kernel))]


@pytest.mark.parametrize("shape", ["module", "builtin"])
def test_an_unbound_tpu_asks_for_a_bind_and_a_bound_one_is_fine(tmp_path, shape):
    kernel = FakeKernel(tmp_path, shape)
    add_tpu(kernel, driver="virtio-pci")
    assert problems(kernel) == ["driven by virtio-pci, not vfio-pci: run `tpuboot bind 0000:00:04.0`"]
    binder(kernel).bind("0000:00:04.0")
    (tpu,) = survey(binder(kernel))
    assert (tpu.driver, tpu.node, tpu.node_mode, tpu.problem) == ("vfio-pci", "/dev/vfio/4", "0666", None)


def test_on_a_kernel_without_vfio_pci_a_bind_cannot_help_and_status_says_why(tmp_path):
    kernel = FakeKernel(tmp_path, "none")
    add_tpu(kernel, driver="virtio-pci")
    (problem,) = problems(kernel)
    assert problem is not None and problem.startswith("kernel 6.1.0-28-cloud-amd64 has no vfio-pci: boot a ")
    assert "tpuboot bind" not in problem


@pytest.mark.parametrize(
    ("shape", "load", "line"),
    [
        ("builtin", False, "vfio-pci: built into kernel 6.8.0-1015-gcp; driver registered"),
        (
            "module",
            False,
            "vfio-pci: a module of kernel 6.1.0-28-cloud-amd64, not loaded (tpuboot loads it to bind a TPU); "
            "driver not registered",
        ),
        ("module", True, "vfio-pci: loaded as a module of kernel 6.1.0-28-cloud-amd64; driver registered"),
        (
            "none",
            False,
            "vfio-pci: not in kernel 6.1.0-28-cloud-amd64: boot a kernel built with CONFIG_VFIO_PCI",
        ),
    ],
)
def test_the_driver_line_says_how_vfio_pci_is_in_the_kernel(tmp_path, shape, load, line):
    kernel = FakeKernel(tmp_path, shape)
    if load:
        kernel.load_module("vfio-pci")
    assert driver_summary(binder(kernel)).startswith(line)


def test_status_shows_the_pcie_link_and_fails_on_a_function_gone_from_the_bus(tmp_path, capsys):
    from tpuboot import cli

    kernel = FakeKernel(tmp_path)
    kernel.load_module("vfio-pci")
    add_tpu(kernel, driver="vfio-pci")
    os.chmod(kernel.p("/dev/vfio/4"), 0o666)
    device = kernel.p("/sys/bus/pci/devices/0000:00:04.0")
    for name, text in [("current_link_speed", "16.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe")]:
        (device / name).write_text(text + "\n")
    for name in ("current_link_width", "max_link_width"):
        (device / name).write_text("16\n")
    assert cli.main(["--root", str(tmp_path), "status"]) == cli.EXIT_OK
    assert "16 GT/s x16 of 16 GT/s x16" in capsys.readouterr().out
    (device / "config").write_bytes(b"\xff" * 64)
    assert cli.main(["--root", str(tmp_path), "status"]) == cli.EXIT_FAILED
    assert "! 0000:00:04.0 does not answer config reads" in capsys.readouterr().out
    assert cli.main(["--root", str(tmp_path), "status", "--json"]) == cli.EXIT_FAILED
    assert '"present": false' in capsys.readouterr().out
