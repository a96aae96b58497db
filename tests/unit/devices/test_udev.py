"""The real pyudev (0.22 on Ubuntu 22.04 to 0.24.3 on Debian 13) as `tpuboot run` uses it at every
start: the monitor opens on the udev netlink source, polls without blocking and wakes the event
loop; devices carry what the daemon reads. The daemon tests feed a fake monitor instead.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

import pytest
import pyudev

from tpuboot.devices.manager import Monitor, UdevDevice
from tpuboot.devices.udev import RECEIVE_BUFFER, open_udev_monitor, set_receive_buffer

PCI_DEVICES = Path("/sys/bus/pci/devices")


def test_the_monitor_opens_and_polls_without_blocking() -> None:
    monitor: Monitor = open_udev_monitor()
    fd = monitor.fileno()
    assert isinstance(fd, int) and fd >= 0
    os.fstat(fd)  # a live descriptor the event loop can watch
    # The monitor takes pci and vfio events only, which a test host does not make: a poll that
    # blocked would wait for one for good, so its end within the generous wait proves it did not.
    polled: list[object] = []
    done = threading.Event()
    threading.Thread(target=lambda: (polled.append(monitor.poll(timeout=0)), done.set()), daemon=True).start()
    assert done.wait(30)
    (event,) = polled
    assert event is None or isinstance(event, pyudev.Device)  # a real event may arrive; none is waited for


def test_monitor_and_device_have_what_the_daemon_reads() -> None:
    for name in ("fileno", "poll", "filter_by", "start", "set_receive_buffer_size"):
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


def rcvbuf(monitor: pyudev.Monitor) -> int:
    """The socket's receive buffer as the kernel reports it (twice what was asked: its bookkeeping)."""
    with socket.fromfd(monitor.fileno(), socket.AF_NETLINK, socket.SOCK_RAW) as sock:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


def test_the_monitor_gets_a_receive_buffer_for_a_boot_time_storm(caplog: pytest.LogCaptureFixture) -> None:
    """As root with CAP_NET_ADMIN (the CI container, the VM) the whole buffer; without it, what
    net.core.rmem_max allows and one line naming the cause, never a failure."""
    with caplog.at_level("INFO", logger="tpuboot"):
        monitor = open_udev_monitor()
    warnings = [r.getMessage() for r in caplog.records if "receive buffer" in r.getMessage()]
    if not warnings:
        assert rcvbuf(monitor) >= 2 * RECEIVE_BUFFER
    else:
        (warning,) = warnings
        assert warning.startswith("udev: receive buffer not raised to 128 MiB (EPERM, needs CAP_NET_ADMIN)")


class RefusingMonitor:
    """A pyudev monitor whose buffer request fails as libudev's does without CAP_NET_ADMIN."""

    def __init__(self) -> None:
        self.inner = pyudev.Monitor.from_netlink(pyudev.Context(), source="udev")
        self.asked: list[int] = []

    def fileno(self) -> int:
        return self.inner.fileno()

    def shrink(self) -> None:
        """As without CAP_NET_ADMIN: the buffer net.core.rmem_max allows (SO_RCVBUF, capped)."""
        with socket.fromfd(self.fileno(), socket.AF_NETLINK, socket.SOCK_RAW) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    def set_receive_buffer_size(self, size: int) -> None:
        self.asked.append(size)
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))


def test_a_refused_receive_buffer_is_one_info_line_with_the_size_in_force(
    caplog: pytest.LogCaptureFixture,
) -> None:
    monitor = RefusingMonitor()
    monitor.shrink()  # libudev took 128 MiB itself when it could: back to what an unprivileged one has
    with caplog.at_level("INFO", logger="tpuboot"):
        set_receive_buffer(monitor)  # type: ignore[arg-type]
    assert monitor.asked == [RECEIVE_BUFFER]
    (record,) = caplog.records
    kib = rcvbuf(monitor.inner) // 2 // 1024
    assert record.levelname == "INFO"  # expected under the unit's sandbox: DeviceManager.rescan covers it
    assert record.getMessage() == (
        "udev: receive buffer not raised to 128 MiB (EPERM, needs CAP_NET_ADMIN); it holds "
        f"{kib} KiB (net.core.rmem_max); should it overflow, the PCI devices are read again"
    )
