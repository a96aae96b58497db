"""The tick's device snapshot (tpuboot/devices/snapshot.py): each reading made when first asked for,
then kept for the round; a round that asks for nothing reads nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import TPU7X, add_tpu, binder
from tpuboot.devices import health as health_module
from tpuboot.devices import survey as survey_module
from tpuboot.devices.snapshot import DeviceSnapshot


def test_each_reading_is_made_once_and_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", TPU7X, driver="vfio-pci", group="4")
    add_tpu(kernel, "0000:00:04.1", TPU7X, driver="vfio-pci", group="5")  # one chip, two functions
    listed: list[object] = []
    read: list[str] = []
    real_list, real_health = survey_module.list_addresses, health_module.read_health
    monkeypatch.setattr(survey_module, "list_addresses", lambda root: listed.append(root) or real_list(root))
    monkeypatch.setattr(
        health_module, "read_health", lambda root, a, b=None: read.append(a) or real_health(root, a, b)
    )
    devices = DeviceSnapshot(binder(kernel))
    assert (listed, read) == ([], [])  # nothing read until a part asks
    (chip,) = devices.chips
    assert [fn.address for fn in chip.functions] == ["0000:00:04.0", "0000:00:04.1"]
    assert chip.nodes == ("/dev/vfio/4", "/dev/vfio/5")
    assert [t.driver for t in devices.tpus] == ["vfio-pci", "vfio-pci"]
    assert sorted(devices.health) == ["0000:00:04.0", "0000:00:04.1"] and devices.health is devices.health
    assert len(listed) == 1 and read == ["0000:00:04.0", "0000:00:04.1"]  # once each, for every reader
