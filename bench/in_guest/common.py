"""What every subcommand of bind_guest.py shares: the edu stand-in, the unprivileged user, a
guest clock, and the proof of use (the VFIO walk of vfio_read.py, in-process)."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, "/usr/local/libexec/tpuboot-test")
from vfio_read import Failure, read_bar0

EDU_ID = 0x010000ED
TESTER = "tester"
CONSOLE = "/dev/ttyS0"
BASELINE_SCRIPT = "/lib/udev/bind_to_vfio_pci.sh"
SHIPPED_CONFIG = "/usr/local/libexec/tpuboot-bench/tpuboot.yaml"  # conf/tpuboot.yaml, as packaged


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def drop_to(user: str) -> None:
    """Become ``user`` for good (groups, gid, uid): what follows proves unprivileged access."""
    entry = pwd.getpwnam(user)
    os.setgroups([g.gr_gid for g in grp.getgrall() if user in g.gr_mem])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


def group_of(addr: str) -> str | None:
    try:
        return os.path.basename(os.readlink(f"/sys/bus/pci/devices/{addr}/iommu_group"))
    except OSError:
        return None


def driver_of(addr: str) -> str | None:
    try:
        return os.path.basename(os.readlink(f"/sys/bus/pci/devices/{addr}/driver"))
    except OSError:
        return None


def node_open_to_all(group: str) -> bool:
    try:
        return os.stat(f"/dev/vfio/{group}").st_mode & 0o006 == 0o006
    except OSError:
        return False


def readable(addr: str) -> bool:
    """vfio_read.py's walk in-process; closes whatever fds a failed attempt left open."""
    before = set(os.listdir("/proc/self/fd"))
    try:
        return read_bar0(addr) == EDU_ID
    except (Failure, OSError):
        return False
    finally:
        for fd in set(os.listdir("/proc/self/fd")) - before:
            with contextlib.suppress(OSError):
                os.close(int(fd))


def unbind(addr: str) -> None:
    """Back to no driver and no override, as ``tpuboot unbind`` leaves an edu device."""
    dev = f"/sys/bus/pci/devices/{addr}"
    with open(f"{dev}/driver_override", "w") as f:
        f.write("\n")
    if os.path.exists(f"{dev}/driver"):
        with open(f"{dev}/driver/unbind", "w") as f:
            f.write(addr)


def timed(argv: Sequence[str]) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    t0 = now()
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    return now() - t0, done
