"""Which binder is armed: driverctl on or off (``driverctl``), back to unbound (``unbind``), and
the metadata address on lo for google-guest-agent (``route-metadata``)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import socket
import struct
import subprocess
from collections.abc import Sequence

from common import driver_of, unbind

DRIVERCTL_RULES = ("05-driverctl.rules", "89-vfio-uio.rules")
DRIVERCTL_CONF = "/etc/driverctl.d"
VFIO_MODE_RULE = "/etc/udev/rules.d/70-tpuboot-bench-vfio-mode.rules"
VFIO_MODE_TEXT = 'SUBSYSTEM=="vfio", MODE="0666"\n'


def driverctl_arm(active: bool, addrs: Sequence[str] = ()) -> None:
    """driverctl as the guest's binder (its rules, the mode rule, ADDR's overrides saved), or inert."""
    subprocess.run(["systemctl", "stop", "driverctl@*.service"], check=False, capture_output=True)
    for path in glob.glob(f"{DRIVERCTL_CONF}/*"):
        os.unlink(path)
    for name in DRIVERCTL_RULES:
        mask = f"/etc/udev/rules.d/{name}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mask)
        if not active:
            os.symlink("/dev/null", mask)
    if active:
        with open(VFIO_MODE_RULE, "w") as f:
            f.write(VFIO_MODE_TEXT)
        os.makedirs(DRIVERCTL_CONF, exist_ok=True)
        for addr in addrs:  # what `driverctl set-override ADDR vfio-pci` saves
            with open(f"{DRIVERCTL_CONF}/pci-{addr}", "w") as f:
                f.write("vfio-pci\n")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(VFIO_MODE_RULE)
    subprocess.run(["udevadm", "control", "--reload"], check=True)


def cmd_driverctl(args: argparse.Namespace) -> int:
    driverctl_arm(args.state == "on", args.addr)
    print(json.dumps({"driverctl": args.state, "overrides": sorted(os.listdir(DRIVERCTL_CONF))
                      if os.path.isdir(DRIVERCTL_CONF) else []}))  # fmt: skip
    return 0


SIOCSIFADDR, SIOCSIFNETMASK = 0x8916, 0x891C


def cmd_route_metadata(args: argparse.Namespace) -> int:
    """``args.address``/32 on ``lo:1``: the guest has no NIC and no iproute2, only ioctls."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for request, addr in ((SIOCSIFADDR, args.address), (SIOCSIFNETMASK, "255.255.255.255")):
            ifreq = struct.pack(
                "16sH2s4s8s", b"lo:1", socket.AF_INET, b"\0\0", socket.inet_aton(addr), b"\0" * 8
            )
            fcntl.ioctl(s.fileno(), request, ifreq)
    print(json.dumps({"lo:1": args.address}))
    return 0


def cmd_unbind(args: argparse.Namespace) -> int:
    for addr in args.addr:
        unbind(addr)
    print(json.dumps({addr: driver_of(addr) for addr in args.addr}))
    return 0
