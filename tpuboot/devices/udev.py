"""Coldplug first: start binding the TPUs already present before the daemon's heavy parts load.

The binds need only sysfs and the device table; the rest of the daemon (requests above all: the
metadata client) takes several times longer to import than eight binds take to run, and far
longer on a slow or emulated CPU. So `tpuboot run` opens the udev monitor, enumerates, hands every
TPU's bind to the worker pool, and only then imports the rest; the daemon adopts the binds in
flight and handles their results like any other. (prometheus_client loads later still, in the
metrics endpoint's own thread: tpuboot/metrics_endpoint.py.)
"""

from __future__ import annotations

import errno
import logging
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpuboot.devices.pci import PciFunction, list_addresses
from tpuboot.devices.vfio import Binder, BindResult

log = logging.getLogger("tpuboot.devices.udev")

if TYPE_CHECKING:
    import pyudev


#: The monitor socket's receive buffer. At boot the kernel and udev announce every device at once;
#: events the daemon has not read yet wait here, and past its size the kernel drops them (ENOBUFS)
#: without a trace. 128 MiB is what systemd-udevd takes, and what libudev itself asks for each
#: monitor since systemd 2xx when it may: tpuboot asks the same on every libudev it runs with, and
#: never less than the socket has. Only the pages used are taken.
RECEIVE_BUFFER = 128 << 20


def set_receive_buffer(monitor: pyudev.Monitor, size: int = RECEIVE_BUFFER) -> None:
    """Ask for ``size`` bytes of receive buffer; a refusal is one line, never a failure.

    libudev sets SO_RCVBUF (capped by net.core.rmem_max), then SO_RCVBUFFORCE, which needs
    CAP_NET_ADMIN. The unit does not grant it (its sandbox would be weaker for a rare event): the
    monitor filters on pci and vfio in the kernel, so only those events fill the buffer, and should
    it overflow, the device manager reads sysfs again (DeviceManager.rescan). So the cap is info.
    """
    if (_rcvbuf(monitor.fileno()) or 0) >= 2 * size:  # the kernel reports twice what was set
        return
    try:
        monitor.set_receive_buffer_size(size)
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        held = _rcvbuf(monitor.fileno())
        log.log(
            logging.INFO if exc.errno == errno.EPERM else logging.WARNING,
            "udev: receive buffer not raised to %d MiB (%s%s); %s; should it overflow, the PCI devices "
            "are read again",
            size >> 20,
            code,
            ", needs CAP_NET_ADMIN" if exc.errno == errno.EPERM else "",
            "its size unknown" if held is None else f"it holds {held // 2048} KiB (net.core.rmem_max)",
        )


def _rcvbuf(fd: int) -> int | None:
    """SO_RCVBUF of the socket ``fd`` as the kernel reports it (twice the bytes asked for)."""
    import socket  # here: `tpuboot run` imports it later, after the binds started

    try:
        with socket.fromfd(fd, socket.AF_NETLINK, socket.SOCK_RAW) as sock:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    except OSError:
        return None


def open_udev_monitor() -> pyudev.Monitor:
    """A started pyudev monitor on the udev source (events after udev's rules ran) for pci and
    vfio, with a receive buffer for a boot-time storm."""
    import pyudev

    monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="udev")
    monitor.filter_by("pci")
    monitor.filter_by("vfio")
    set_receive_buffer(monitor)
    monitor.start()
    return monitor


POOL_WORKERS = 8  # the most chips a TPU VM has: all of them bind at once


def new_executor() -> ThreadPoolExecutor:
    """The daemon's pool: binds and other blocking sysfs and file work run there."""
    return ThreadPoolExecutor(max_workers=POOL_WORKERS, thread_name_prefix="tpuboot")


@dataclass
class Coldplug:
    """The PCI functions present at start, and the binds already running for the TPUs among them."""

    addresses: list[str]
    binds: dict[str, Future[BindResult]]
    started: float  # monotonic, for the bind-duration metric


def start_coldplug(binder: Binder, executor: Executor) -> Coldplug:
    """Submit a bind for every managed TPU present; call with the udev monitor already started.

    Never raises for a device: each bind's errors come back through its future.
    """
    started = time.monotonic()
    try:
        addresses = list_addresses(binder.root)
    except OSError as exc:  # the daemon still binds what udev announces from now on
        log.error("cannot list PCI devices (%s); binding only devices added from now on", exc)
        addresses = []
    binds = {}
    for address in addresses:
        try:
            kind = binder.kind_of(PciFunction(binder.root, address))
        except OSError:
            # Gone again, not a full PCI function, or its ids unreadable: the daemon classifies
            # it again, and reports and retries a failure as that device's (DeviceManager.consider).
            continue
        if kind is not None and kind.vfio:
            binds[address] = executor.submit(binder.bind, address)
    return Coldplug(addresses, binds, started)
