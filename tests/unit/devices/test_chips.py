"""Chips from PCI functions: one per base address, numbered as tpu-info numbers them, with the
nodes a runtime opens (a group's /dev/vfio node, or the accel driver's /dev/accelN)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import TPU7X, V4, V5P, add, surveyed
from tpuboot.config import MatchRule
from tpuboot.devices.chips import ChipFunction, accel_nodes, base_address, chips_present, group_chips
from tpuboot.devices.table import GOOGLE, DeviceTable

VFIO = "vfio-pci"
V3 = (GOOGLE, 0x0027, (GOOGLE, 0x004F))


def test_base_address_drops_the_function_only() -> None:
    assert base_address("0000:8a:1f.7") == "0000:8a:1f"
    assert base_address("10000:00:04.0") == "10000:00:04"


def test_two_functions_of_a_tpu7x_chip_are_one_chip_with_both_groups(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    for address, group in [("0000:05:00.0", "12"), ("0000:05:00.1", "13"), ("0000:06:00.0", "140")]:
        add(kernel, address, TPU7X, group)
    table = DeviceTable()
    chips = chips_present(kernel.root, table, surveyed(kernel, table))
    assert [(c.index, c.address, len(c.functions), c.complete) for c in chips] == [
        (0, "0000:05:00", 2, True),
        (1, "0000:06:00", 1, False),
    ]
    assert chips[0].nodes == ("/dev/vfio/12", "/dev/vfio/13")
    assert chips[1].nodes == ("/dev/vfio/140",)  # a group number of any length
    assert all(c.uses_vfio for c in chips)


def test_one_function_chips_each_count_and_number_in_address_order(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    for address, group in [("0000:00:07.0", "7"), ("0000:00:04.0", "4"), ("0000:00:05.0", "5")]:
        add(kernel, address, V5P, group)
    table = DeviceTable()
    chips = chips_present(kernel.root, table, surveyed(kernel, table))
    assert [(c.index, c.address, c.nodes) for c in chips] == [
        (0, "0000:00:04", ("/dev/vfio/4",)),
        (1, "0000:00:05", ("/dev/vfio/5",)),
        (2, "0000:00:07", ("/dev/vfio/7",)),
    ]


def test_a_function_not_bound_to_vfio_pci_has_no_vfio_node(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    add(kernel, "0000:00:04.0", V5P, "4", driver="virtio-pci")
    table = DeviceTable()
    (chip,) = chips_present(kernel.root, table, surveyed(kernel, table))
    assert chip.nodes == () and chip.uses_vfio


def test_accel_chips_are_reached_through_their_accel_nodes(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    add(kernel, "0000:00:04.0", V3, None, driver="accel")
    add(kernel, "0000:00:04.1", V3, None, driver="accel")
    add(kernel, "0000:00:05.0", V4, None, driver="accel")
    for address, node in [("0000:00:04.0", "accel0"), ("0000:00:04.1", "accel1"), ("0000:00:05.0", "accel2")]:
        kernel.p(f"/sys/bus/pci/devices/{address}/accel/{node}").mkdir(parents=True)
    table = DeviceTable()
    chips = chips_present(kernel.root, table, surveyed(kernel, table))
    assert [(c.kind, c.nodes, c.uses_vfio, c.complete) for c in chips] == [
        ("TPU v2/v3", ("/dev/accel0", "/dev/accel1"), False, True),
        ("TPU v4", ("/dev/accel2",), False, True),
    ]
    assert accel_nodes(kernel.root, "0000:00:09.0") == ()


def test_configured_stand_ins_are_vfio_chips_of_one_function(tmp_path: Path) -> None:
    table = DeviceTable([MatchRule(vendor=0x1234, device=0x11E8, name="edu")])
    chips = group_chips(
        [ChipFunction("0000:01:00.0", "edu", "9"), ChipFunction("0000:02:00.0", "edu", "10")], table
    )
    assert [(c.nodes, c.expected_functions, c.uses_vfio) for c in chips] == [
        (("/dev/vfio/9",), 1, True),
        (("/dev/vfio/10",), 1, True),
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_functions_sharing_a_group_give_its_node_once(shared: bool) -> None:
    groups = ("3", "3") if shared else ("3", "4")
    functions = [ChipFunction(f"0000:05:00.{i}", "TPU7x", g) for i, g in enumerate(groups)]
    (chip,) = group_chips(functions, DeviceTable())
    assert chip.nodes == (("/dev/vfio/3",) if shared else ("/dev/vfio/3", "/dev/vfio/4"))
