"""The real pyudev (0.22 on Ubuntu 22.04 to 0.24.3 on Debian 13) as `tpuboot run` uses it at every
start: the monitor opens on the udev netlink source, polls without blocking and wakes the event
loop; devices carry what the daemon reads. The daemon tests feed a fake monitor instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import pyudev

from tpuboot.daemon import Monitor, UdevDevice
from tpuboot.devices.udev import open_udev_monitor

PCI_DEVICES = Path("/sys/bus/pci/devices")


def test_the_monitor_opens_and_polls_without_blocking() -> None:
    monitor: Monitor = open_udev_monitor()
    fd = monitor.fileno()
    assert isinstance(fd, int) and fd >= 0
    os.fstat(fd)  # a live descriptor the event loop can watch
    started = time.monotonic()
    event = monitor.poll(timeout=0)
    assert time.monotonic() - started < 1.0
    assert event is None or isinstance(event, pyudev.Device)  # a real event may arrive; none is waited for


def test_monitor_and_device_have_what_the_daemon_reads() -> None:
    for name in ("fileno", "poll", "filter_by", "start"):
        assert callable(getattr(pyudev.Monitor, name, None)), f"pyudev.Monitor.{name}"
    for name in ("action", "subsystem", "sys_name"):
        assert isinstance(getattr(pyudev.Device, name, None), property), f"pyudev.Device.{name}"


@pytest.mark.skipif(not PCI_DEVICES.is_dir() or not any(PCI_DEVICES.iterdir()), reason="no PCI devices")
def test_a_real_pci_device_reads_as_the_daemon_expects() -> None:
    path = sorted(PCI_DEVICES.iterdir())[0].resolve()
    device: UdevDevice = pyudev.Devices.from_sys_path(pyudev.Context(), str(path))
    assert device.subsystem == "pci"
    assert device.sys_name == path.name
    assert device.action is None  # only events have an action
