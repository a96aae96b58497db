"""Where start-up time goes: the CLI against the documented script (``cli``), each import step of
``tpuboot run`` (``imports``) and tpuboot's own functions stamped (``profile``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from common import BASELINE_SCRIPT, SHIPPED_CONFIG, driver_of, group_of, node_open_to_all, now, timed, unbind


def cmd_cli(args: argparse.Namespace) -> int:
    commands = {
        "tpuboot": ["tpuboot", "bind", args.addr],
        # The shipped config is all comments (no yaml import); edu is no TPU there, hence --force.
        "tpuboot, shipped config": ["tpuboot", "--config", SHIPPED_CONFIG, "bind", "--force", args.addr],
        "baseline": [BASELINE_SCRIPT, args.addr],
    }
    floors = {
        "python3 -c pass": ["python3", "-c", "pass"],
        "import tpuboot.cli": ["python3", "-c", "import tpuboot.cli"],
        "bash -c true": ["bash", "-c", "true"],
    }
    times: dict[str, list[float]] = {name: [] for name in [*commands, *floors]}
    errors: list[str] = []
    for argv in commands.values():  # warm-up: page cache, vfio-pci already loaded
        unbind(args.addr)
        timed(argv)
    for i in range(args.runs):
        names = list(commands)
        order = names[i % len(names) :] + names[: i % len(names)]  # each first in turn
        for name in order:
            unbind(args.addr)
            seconds, done = timed(commands[name])
            group = group_of(args.addr)
            ok = done.returncode == 0 and driver_of(args.addr) == "vfio-pci" and group is not None
            if not (ok and group is not None and node_open_to_all(group)):
                errors.append(f"{name} run {i}: rc {done.returncode}: {done.stderr.decode()[-300:]}")
            times[name].append(seconds)
    for name, argv in floors.items():
        for _ in range(args.floor_runs):
            times[name].append(timed(argv)[0])
    print(json.dumps({"times": times, "errors": errors}))
    return 1 if errors else 0


# Cumulative steps in the order `tpuboot run` meets them: `tpuboot bind` stops after its command's
# module (tpuboot/commands/devices.py).
IMPORT_STEPS = (
    ("yaml", "yaml"),
    ("rest of tpuboot.cli", "tpuboot.cli, tpuboot.commands.devices"),
    ("systemd.daemon", "systemd.daemon"),
    ("pyudev", "pyudev"),
    ("requests", "requests"),
    ("rest of tpuboot.daemon/env/gce", "tpuboot.daemon, tpuboot.env.sync, tpuboot.gce.client"),
)
_IMPORT_SCRIPT = """
import json, sys, time
def report(step):
    rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    print(json.dumps([step, time.clock_gettime(time.CLOCK_MONOTONIC), rss]), flush=True)
report("interpreter")
for step, modules in json.loads(sys.argv[1]):
    exec("import " + modules)
    report(step)
"""


def cmd_imports(args: argparse.Namespace) -> int:
    """Wall time and RSS each import step adds, from a fresh interpreter (best of ``--runs``)."""
    best: dict[str, list[float]] = {}
    for _ in range(args.runs):
        start = now()
        out = subprocess.run(
            ["python3", "-c", _IMPORT_SCRIPT, json.dumps(IMPORT_STEPS)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        previous, previous_rss = start, 0
        for line in out.stdout.splitlines():
            step, at, rss = json.loads(line)
            cost = [at - previous, rss - previous_rss]
            best[step] = [min(a, b) for a, b in zip(best.get(step, cost), cost, strict=True)]
            previous, previous_rss = at, rss
    print(json.dumps({"steps": [{"step": k, "s": v[0], "rss_kib": v[1]} for k, v in best.items()]}))
    return 0


# Runs tpuboot's own main() with monotonic stamps around its imports and key functions; the
# stamps are seconds since the parent spawned this interpreter (argv[1]).
_PROFILE_SCRIPT = """
import builtins, functools, json, os, signal, sys, time
T0, mode, argv = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
events = []
def stamp(what):
    events.append((what, time.clock_gettime(time.CLOCK_MONOTONIC) - T0))
stamp("interpreter")
import tpuboot.cli as cli
stamp("import tpuboot.cli")
def wrap(owner, name):
    inner = getattr(owner, name)
    @functools.wraps(inner)
    def traced(*args, **kwargs):
        stamp("> " + name)
        try:
            return inner(*args, **kwargs)
        finally:
            stamp("< " + name)
    setattr(owner, name, traced)
from tpuboot.devices.vfio import Binder
for name in ("bind", "_attach", "prepare_node"):
    wrap(Binder, name)
import tpuboot.commands.context as context  # every command reads its config there
wrap(context, "load_config")
if mode == "run":
    import tpuboot.devices.udev
    from tpuboot.notify import Notifier
    wrap(tpuboot.devices.udev, "open_udev_monitor")
    wrap(tpuboot.devices.udev, "start_coldplug")
    real_import = builtins.__import__
    ENDS = ("tpuboot.daemon", "tpuboot.env.sync", "tpuboot.gce.client")
    def stamping_import(name, globals=None, locals=None, fromlist=(), level=0):
        # `tpuboot run` imports the boot parts after coldplug started, the daemon's loop first:
        # stamp from the daemon's import to the end of the last of the three (wiring imports the
        # env sync and the metadata client after the daemon; the segment takes the last end).
        daemon = name == "tpuboot.daemon" or (name == "tpuboot" and "daemon" in (fromlist or ()))
        if daemon and "tpuboot.daemon" not in sys.modules:
            stamp("> import daemon, envsync, metadata")
        target = "tpuboot.daemon" if daemon else name
        first = target in ENDS and target not in sys.modules
        module = real_import(name, globals, locals, fromlist, level)
        if first:
            stamp("< import daemon, envsync, metadata")
        if name == "tpuboot.env.sync" and not hasattr(sys.modules[name].EnvSync.sync_once, "__wrapped__"):
            wrap(sys.modules[name].EnvSync, "sync_once")
        return module
    builtins.__import__ = stamping_import
    def ready(self, line):
        stamp("READY")
        os.kill(os.getpid(), signal.SIGTERM)
    Notifier.ready = ready
rc = cli.main(argv)
stamp("main returned")
print(json.dumps(events))
sys.exit(rc)
"""


def cmd_profile(args: argparse.Namespace) -> int:
    """tpuboot's own code, stamped: where ``tpuboot bind`` or ``tpuboot run``'s coldplug spend time."""
    env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
    argv = ["bind", args.addr[0]] if args.mode == "bind" else ["run"]
    runs = []
    for _ in range(args.runs):
        for addr in args.addr:
            unbind(addr)
        start = now()
        done = subprocess.run(
            ["python3", "-c", _PROFILE_SCRIPT, str(start), args.mode, *argv],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        wall = now() - start
        if done.returncode != 0:
            print(json.dumps({"error": done.stderr[-2000:]}))
            return 1
        runs.append({"wall": wall, "events": json.loads(done.stdout.splitlines()[-1])})
    print(json.dumps({"runs": runs}))
    return 0
