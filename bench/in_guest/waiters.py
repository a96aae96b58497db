"""Waiting, as ``tester``, until devices are usable: after a hot add (``hotplug``, ``cdi``), after a
boot job (``coldplug``) and after a bind command (``usable``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from arming import driverctl_arm
from common import (
    BASELINE_SCRIPT,
    CONSOLE,
    TESTER,
    driver_of,
    drop_to,
    group_of,
    node_open_to_all,
    now,
    readable,
    unbind,
)


def cmd_hotplug(args: argparse.Namespace) -> int:
    console = os.open(CONSOLE, os.O_WRONLY | os.O_NOCTTY)
    drop_to(TESTER)
    marks: dict[str, float | None] = dict.fromkeys(("appear", "bound", "node", "mode", "usable"))
    dev = f"/sys/bus/pci/devices/{args.addr}"
    group: str | None = None
    start = now()
    os.write(console, f"\n{args.tag}r{start:.6f}\n".encode())
    deadline = start + args.timeout
    while now() < deadline:
        if marks["appear"] is None and os.path.isdir(dev):
            marks["appear"] = now()
        if marks["appear"] is not None:
            if marks["bound"] is None and driver_of(args.addr) == "vfio-pci":
                marks["bound"] = now()
            group = group or group_of(args.addr)
            if group is not None:
                if marks["node"] is None and os.path.exists(f"/dev/vfio/{group}"):
                    marks["node"] = now()
                if node_open_to_all(group):
                    marks["mode"] = marks["mode"] or now()
                    if readable(args.addr):
                        marks["usable"] = t = now()
                        os.write(console, f"\n{args.tag}u{t:.6f}\n".encode())
                        break
        time.sleep(args.interval)
    print(json.dumps({"start": start, **marks}))
    return 0 if marks["usable"] is not None else 1


def cmd_cdi(args: argparse.Namespace) -> int:
    """Until a hot-added device is usable by tester and its node is in tpuboot's CDI spec: both
    stamps on the guest clock (a ready marker on the console first, so the add comes after)."""
    console = os.open(CONSOLE, os.O_WRONLY | os.O_NOCTTY)
    drop_to(TESTER)
    marks: dict[str, float | None] = dict.fromkeys(("usable", "spec"))
    group: str | None = None
    start = now()
    os.write(console, f"\n{args.tag}r{start:.6f}\n".encode())
    deadline = start + args.timeout
    while now() < deadline and None in marks.values():
        group = group or group_of(args.addr)
        if group is not None:
            if marks["usable"] is None and node_open_to_all(group) and readable(args.addr):
                marks["usable"] = now()
            if marks["spec"] is None:
                try:
                    with open(args.spec) as f:
                        if f'"/dev/vfio/{group}"' in f.read():
                            marks["spec"] = now()
                except FileNotFoundError:
                    pass
        time.sleep(args.interval)
    print(json.dumps({"start": start, **marks}))
    return 0 if None not in marks.values() else 1


def cmd_coldplug(args: argparse.Namespace) -> int:
    groups = {a: group_of(a) for a in args.addr}
    already = [a for a in args.addr if driver_of(a) is not None]  # a valid run starts from none
    if already:
        print(json.dumps({"bound_at_start": already}))
        return 0
    start = now()
    proc = subprocess.Popen(args.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    drop_to(TESTER)
    usable: dict[str, float] = {}
    done: float | None = None
    deadline = start + args.timeout
    while now() < deadline and (done is None or len(usable) < len(groups)):
        if done is None and proc.poll() is not None:
            done = now() - start
        for addr, group in groups.items():
            if addr not in usable and group and node_open_to_all(group) and readable(addr):
                usable[addr] = now() - start
        time.sleep(args.interval)
    stderr = proc.stderr.read().decode(errors="replace") if done is not None and proc.stderr else ""
    result = {
        "command_s": done,
        "rc": proc.returncode,
        "stderr": stderr[-2000:],
        "usable_s": usable,
        "all_usable_s": max(usable.values()) if len(usable) == len(groups) else None,
        "bound_at_start": [],
    }
    print(json.dumps(result))
    return 0 if result["all_usable_s"] is not None and proc.returncode == 0 else 1


def until_usable(addr: str, argv: Sequence[str], interval: float, timeout: float = 30.0) -> dict[str, Any]:
    """Run ``argv`` as root while a forked child, already ``tester``, polls until ADDR is usable."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the poller: unprivileged before the clock starts
        code = 1
        try:
            drop_to(TESTER)
            os.write(ready_w, b"r")
            start = float(os.read(go_r, 64))
            group = None
            usable = None
            while now() < start + timeout:
                group = group or group_of(addr)
                if group is not None and node_open_to_all(group) and readable(addr):
                    usable = now() - start
                    break
                time.sleep(interval)
            os.write(out_w, json.dumps(usable).encode())
            code = 0
        finally:
            os._exit(code)
    for fd in (ready_w, go_r, out_w):
        os.close(fd)
    try:
        os.read(ready_r, 1)
        start = now()
        os.write(go_w, repr(start).encode())
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
        command_s = now() - start
        usable = json.loads(os.read(out_r, 64) or b"null")
    finally:
        os.waitpid(pid, 0)
        for fd in (ready_r, go_w, out_r):
            os.close(fd)
    return {"command_s": command_s, "usable_s": usable, "rc": done.returncode,
            "stderr": done.stderr.decode(errors="replace")[-300:]}  # fmt: skip


def cmd_usable(args: argparse.Namespace) -> int:
    """Each binder by hand until tester can use the device, each first in turn, each alone armed."""
    commands = {
        "tpuboot": ["tpuboot", "bind", args.addr],
        "baseline": [BASELINE_SCRIPT, args.addr],
        "driverctl": ["driverctl", "set-override", args.addr, "vfio-pci"],
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in commands}
    errors: list[str] = []
    for i in range(args.runs + 1):  # the first round is a warm-up
        names = list(commands)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            driverctl_arm(name == "driverctl")
            unbind(args.addr)
            subprocess.run(["udevadm", "settle", "--timeout=30"], check=False)
            result = until_usable(args.addr, commands[name], args.interval)
            if result["rc"] != 0 or result["usable_s"] is None:
                errors.append(f"{name} run {i}: {result}")
            if i > 0:
                runs[name].append(result)
    driverctl_arm(False)
    print(json.dumps({"runs": runs, "errors": errors}))
    return 1 if errors else 0
