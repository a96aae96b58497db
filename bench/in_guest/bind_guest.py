#!/usr/bin/python3
"""Guest side of ``bench.run``: the clocks and waiters that run inside the VM (stdlib only).

Copied into the guest image with the other modules of ``bench/in_guest/`` (one per kind of
subcommand: waiters, startup, idle, arming; common) as ``/usr/local/libexec/tpuboot-bench/``.
Each subcommand prints one JSON object on stdout; times are guest CLOCK_MONOTONIC seconds.

* ``hotplug ADDR``: wait for ADDR to appear and become usable by ``tester``; phase times.
  Writes short markers on the console (ttyS0) when ready to wait and when usable, so the host
  can stamp the moment on its own clock (the console is a file the host polls).
* ``coldplug ADDR... --command CMD``: run CMD as root, then (as ``tester``) poll until every ADDR is
  usable; when CMD returned and when each ADDR became usable, relative to CMD's start. Runs
  nothing, and says which, if an ADDR is bound already.
* ``unbind ADDR...``: back to no driver and no driver_override (the state after a hot add).
* ``cli ADDR --runs N``: wall time of ``tpuboot bind`` (with the bench's config, and with the
  shipped one) and of the baseline script, interleaved with each first in turn, the device
  unbound before each run; plus the Python start-up floor.
* ``imports``: what each import step of ``tpuboot run`` adds in wall time and RSS.
* ``profile bind|run ADDR...``: tpuboot's main() with stamps around its imports and key functions.
* ``driverctl on ADDR... | off``: arm driverctl (its udev rules unmasked, the /dev/vfio mode
  rule, ADDR's overrides saved as ``driverctl set-override`` saves them) or disarm it (rules
  masked, overrides and driverctl@ units gone).
* ``usable ADDR --runs N``: ``tpuboot bind``, the documented script and ``driverctl
  set-override``, each until ``tester`` can use the device (a forked poller, as tester).
* ``route-metadata``: 169.254.169.254 on lo (no iproute2 in the guest), for google-guest-agent.
* ``idle PID``: per-thread wakeups, CPU ticks and RSS of PID over the life of a
  ``python3 -c 'import time; time.sleep(60)'`` process, whose RSS is the baseline.

"Usable" is the real proof: the VFIO type1 walk of ``vfio_read.py`` (container, group, IOMMU,
device fd, BAR0 read = 0x010000ed) done in-process as uid ``tester``, so a poll costs an
open() and not a Python start-up. A cheap gate (the node's mode lets others read and write)
comes first; the gate is necessary for tester's access, so it delays nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from arming import cmd_driverctl, cmd_route_metadata, cmd_unbind
from idle import cmd_idle
from startup import cmd_cli, cmd_imports, cmd_profile
from waiters import cmd_cdi, cmd_coldplug, cmd_hotplug, cmd_usable


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("hotplug")
    p.add_argument("addr")
    p.add_argument("--tag", required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=0.005)
    p.set_defaults(func=cmd_hotplug)
    p = sub.add_parser("cdi")
    p.add_argument("addr")
    p.add_argument("--spec", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--interval", type=float, default=0.002)
    p.set_defaults(func=cmd_cdi)
    p = sub.add_parser("coldplug")
    p.add_argument("addr", nargs="+")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--command", required=True, type=shlex.split, help="shell words, run as root")
    p.set_defaults(func=cmd_coldplug)
    p = sub.add_parser("unbind")
    p.add_argument("addr", nargs="+")
    p.set_defaults(func=cmd_unbind)
    p = sub.add_parser("cli")
    p.add_argument("addr")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--floor-runs", type=int, default=3)
    p.set_defaults(func=cmd_cli)
    p = sub.add_parser("imports")
    p.add_argument("--runs", type=int, default=2)
    p.set_defaults(func=cmd_imports)
    p = sub.add_parser("profile")
    p.add_argument("mode", choices=("bind", "run"))
    p.add_argument("addr", nargs="+", help="unbound before each run; bind mode binds the first")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("idle")
    p.add_argument("pid", type=int)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--stats", help="the metadata emulator's stats URL: its requests during the window")
    p.set_defaults(func=cmd_idle)
    p = sub.add_parser("driverctl")
    p.add_argument("state", choices=("on", "off"))
    p.add_argument("addr", nargs="*", help="devices whose override is saved (on)")
    p.set_defaults(func=cmd_driverctl)
    p = sub.add_parser("usable")
    p.add_argument("addr")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--interval", type=float, default=0.005)
    p.set_defaults(func=cmd_usable)
    p = sub.add_parser("route-metadata")
    p.add_argument("--address", default="169.254.169.254")
    p.set_defaults(func=cmd_route_metadata)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
