#!/usr/bin/python3
"""Prove that a device bound to vfio-pci is usable without root (stdlib only).

Usage: vfio_read.py DBDF [OFFSET]

Walks the VFIO type1 path a user-space driver such as libtpu takes -- container,
group, IOMMU, device fd -- and reads 4 bytes of BAR0 at OFFSET (default 0),
printed as 0x%08x. QEMU's edu device answers 0x010000ed at offset 0. On any
failure prints one line naming the failing step and errno, and exits 1.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
from collections.abc import Callable
from typing import Any

# <linux/vfio.h>: _IO(VFIO_TYPE, VFIO_BASE + n), VFIO_TYPE = ';', VFIO_BASE = 100.
_VFIO = ord(";") << 8
VFIO_GET_API_VERSION = _VFIO | 100
VFIO_CHECK_EXTENSION = _VFIO | 101
VFIO_SET_IOMMU = _VFIO | 102
VFIO_GROUP_GET_STATUS = _VFIO | 103
VFIO_GROUP_SET_CONTAINER = _VFIO | 104
VFIO_GROUP_GET_DEVICE_FD = _VFIO | 106
VFIO_DEVICE_GET_REGION_INFO = _VFIO | 108

VFIO_API_VERSION = 0
VFIO_TYPE1_IOMMU = 1
VFIO_GROUP_FLAGS_VIABLE = 1 << 0
VFIO_REGION_INFO_FLAG_READ = 1 << 0
VFIO_PCI_BAR0_REGION_INDEX = 0

GROUP_STATUS = struct.Struct("=II")  # argsz, flags
REGION_INFO = struct.Struct("=IIIIQQ")  # argsz, flags, index, cap_offset, size, offset


class Failure(Exception):
    """One step failed; str() is the one-line message."""


def _step(name: str, func: Callable[..., Any], *args: Any) -> Any:
    try:
        return func(*args)
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "?")
        raise Failure(f"{name} failed: {code} ({exc.errno}) {exc.strerror}") from exc


def open_device(dbdf: str) -> int:
    """The device fd of the vfio-bound device ``dbdf``, with its group's and container's fds
    closed: VFIO keeps both alive for as long as the device fd is open."""
    container, group_fd, device = device_fds(dbdf)
    os.close(group_fd)
    os.close(container)
    return device


def device_fds(dbdf: str) -> tuple[int, int, int]:
    """(container, group, device) fds of the vfio-bound device ``dbdf``, as a driver takes them."""
    link = f"/sys/bus/pci/devices/{dbdf}/iommu_group"
    group = os.path.basename(_step(f"readlink {link}", os.readlink, link))

    container = _step("open /dev/vfio/vfio", os.open, "/dev/vfio/vfio", os.O_RDWR | os.O_CLOEXEC)
    version = _step("VFIO_GET_API_VERSION", fcntl.ioctl, container, VFIO_GET_API_VERSION)
    if version != VFIO_API_VERSION:
        raise Failure(f"VFIO_GET_API_VERSION returned {version}, expected {VFIO_API_VERSION}")
    if not _step("VFIO_CHECK_EXTENSION", fcntl.ioctl, container, VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU):
        raise Failure("VFIO_CHECK_EXTENSION: VFIO_TYPE1_IOMMU not supported")

    path = f"/dev/vfio/{group}"
    group_fd = _step(f"open {path}", os.open, path, os.O_RDWR | os.O_CLOEXEC)
    status = bytearray(GROUP_STATUS.pack(GROUP_STATUS.size, 0))
    _step("VFIO_GROUP_GET_STATUS", fcntl.ioctl, group_fd, VFIO_GROUP_GET_STATUS, status)
    if not GROUP_STATUS.unpack(status)[1] & VFIO_GROUP_FLAGS_VIABLE:
        raise Failure(
            f"VFIO_GROUP_GET_STATUS: group {group} is not viable (a device in it is not bound to vfio)"
        )
    container_arg = struct.pack("=i", container)
    _step("VFIO_GROUP_SET_CONTAINER", fcntl.ioctl, group_fd, VFIO_GROUP_SET_CONTAINER, container_arg)
    _step("VFIO_SET_IOMMU", fcntl.ioctl, container, VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU)

    # A mutable buffer makes fcntl.ioctl return the syscall's result: the new fd.
    name = bytearray(dbdf.encode() + b"\0")
    device = _step("VFIO_GROUP_GET_DEVICE_FD", fcntl.ioctl, group_fd, VFIO_GROUP_GET_DEVICE_FD, name)
    return container, group_fd, device


def read_bar0(dbdf: str, offset: int = 0) -> int:
    """The 32-bit value at ``offset`` of BAR0 of the vfio-bound device ``dbdf``."""
    _, _, device = device_fds(dbdf)
    info = bytearray(REGION_INFO.pack(REGION_INFO.size, 0, VFIO_PCI_BAR0_REGION_INDEX, 0, 0, 0))
    _step("VFIO_DEVICE_GET_REGION_INFO", fcntl.ioctl, device, VFIO_DEVICE_GET_REGION_INFO, info)
    _, flags, _, _, size, region_offset = REGION_INFO.unpack(info)
    if not flags & VFIO_REGION_INFO_FLAG_READ or size < offset + 4:
        raise Failure(f"VFIO_DEVICE_GET_REGION_INFO: BAR0 not readable (flags={flags:#x}, size={size})")
    data = _step("pread BAR0", os.pread, device, 4, region_offset + offset)
    if len(data) != 4:
        raise Failure(f"pread BAR0: short read of {len(data)} bytes")
    value: int = struct.unpack("<I", data)[0]
    return value


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(f"usage: {argv[0]} DBDF [OFFSET]", file=sys.stderr)
        return 2
    try:
        value = read_bar0(argv[1], int(argv[2], 0) if len(argv) == 3 else 0)
    except Failure as exc:
        print(f"vfio_read: {exc}", file=sys.stderr)
        return 1
    print(f"0x{value:08x}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
