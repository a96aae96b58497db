#!/usr/bin/python3
"""Guest side of ``bench.run``: the clocks and waiters that run inside the VM (stdlib only).

Copied into the guest image as ``/usr/local/libexec/tpuboot-bench/bind_guest.py``. Each
subcommand prints one JSON object on stdout; times are guest CLOCK_MONOTONIC seconds.

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
import contextlib
import fcntl
import glob
import grp
import json
import os
import pwd
import shlex
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, "/usr/local/libexec/tpuboot-test")
from vfio_read import Failure, read_bar0

EDU_ID = 0x010000ED
TESTER = "tester"
CONSOLE = "/dev/ttyS0"
BASELINE_SCRIPT = "/lib/udev/bind_to_vfio_pci.sh"
SHIPPED_CONFIG = "/usr/local/libexec/tpuboot-bench/tpuboot.yaml"  # conf/tpuboot.yaml, as packaged
SYS_CLOCK_NANOSLEEP = 230  # x86_64
# x86_64 numbers of the calls an idle thread blocks in; the value says where its fd argument is.
SYS_CALLS: dict[int, tuple[str, str | None]] = {
    0: ("read", "fd"), 7: ("poll", "pollfd"), 23: ("select", None), 45: ("recvfrom", "fd"),
    47: ("recvmsg", "fd"), 61: ("wait4", None), 202: ("futex", None), 230: ("clock_nanosleep", None),
    232: ("epoll_wait", "fd"), 270: ("pselect6", None), 271: ("ppoll", "pollfd"), 281: ("epoll_pwait", "fd"),
}  # fmt: skip


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


# --------------------------------------------------------------------------- hotplug


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


# --------------------------------------------------------------------------- coldplug


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


# --------------------------------------------------------------------------- cli


def timed(argv: Sequence[str]) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    t0 = now()
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    return now() - t0, done


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


# --------------------------------------------------------------------------- imports

# Cumulative steps in the order `tpuboot run` meets them: `tpuboot bind` stops after tpuboot.cli.
IMPORT_STEPS = (
    ("yaml", "yaml"),
    ("rest of tpuboot.cli", "tpuboot.cli"),
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


# --------------------------------------------------------------------------- profile

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
wrap(cli, "load_config")
if mode == "run":
    import tpuboot.devices.udev
    from tpuboot.notify import Notifier
    wrap(tpuboot.devices.udev, "open_udev_monitor")
    wrap(tpuboot.devices.udev, "start_coldplug")
    real_import = builtins.__import__
    def stamping_import(name, globals=None, locals=None, fromlist=(), level=0):
        # `tpuboot run` imports the daemon's heavy parts after coldplug started: stamp that span.
        wanted = name == "tpuboot.daemon" or (name == "tpuboot" and "daemon" in (fromlist or ()))
        first = wanted and "tpuboot.daemon" not in sys.modules
        if first:
            stamp("> import daemon, envsync, metadata")
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


# --------------------------------------------------------------------------- idle


def _fields(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _kib(status: dict[str, str], key: str) -> int:
    return int(status[key].split()[0])


def _hex_endpoint(text: str) -> str:
    """``0100007F:1F90`` (as /proc/net/tcp writes it) -> ``127.0.0.1:8080``; IPv6 kept in hex."""
    addr, port = text.split(":")
    host = ".".join(str(b) for b in bytes.fromhex(addr)[::-1]) if len(addr) == 8 else f"[{addr}]"
    return f"{host}:{int(port, 16)}"


def describe_fd(pid: int, fd: int) -> str:
    """What fd ``fd`` of ``pid`` is: a TCP endpoint (listening or connected), a socket kind, a path."""
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return f"fd {fd}"
    if not (link.startswith("socket:[") or link.startswith("anon_inode:")):
        return link
    inode = link.removeprefix("socket:[").rstrip("]")
    for table in ("tcp", "tcp6", "udp", "udp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] == inode:
                    local, remote = _hex_endpoint(cols[1]), _hex_endpoint(cols[2])
                    return (
                        f"{table} listening on {local}" if cols[3] == "0A" else f"{table} {local} -> {remote}"
                    )
    for table in ("netlink", "unix"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            if any(inode in line.split() for line in f.readlines()[1:]):
                return f"{table} socket"
    return link


def blocked_in(pid: int, tid: str) -> dict[str, Any]:
    """The system call a thread sleeps in, its timeout (ms, where the call has one) and what it waits on."""
    with open(f"/proc/{pid}/task/{tid}/syscall") as f:
        fields = f.read().split()
    if not fields or not fields[0].isdigit():
        return {"syscall": fields[0] if fields else "?"}
    nr, args = int(fields[0]), [int(x, 16) for x in fields[1:7]]
    name, fd_kind = SYS_CALLS.get(nr, (f"syscall {nr}", None))
    info: dict[str, Any] = {"syscall": name}
    if nr in (7, 232, 281):  # poll(fds, nfds, timeout), epoll_wait(epfd, events, max, timeout)
        timeout = args[2] if nr == 7 else args[3]
        info["timeout_ms"] = timeout - (1 << 32) if timeout >= 1 << 31 else timeout
    fd = None
    if fd_kind == "fd":
        fd = args[0]
    elif fd_kind == "pollfd" and args[1] >= 1:  # the first struct pollfd {int fd; short; short}
        with contextlib.suppress(OSError), open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            fd = int.from_bytes(os.pread(mem.fileno(), 4, args[0]), "little", signed=True)
    if fd is not None and fd >= 0:
        info["waits_on"] = describe_fd(pid, fd)
    return info


def thread_snapshot(pid: int) -> dict[str, dict[str, Any]]:
    """Per thread: name, blocking syscall, context switches, timeslices, CPU ticks."""
    threads: dict[str, dict[str, Any]] = {}
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        base = f"/proc/{pid}/task/{tid}"
        try:
            status = _fields(f"{base}/status")
            with open(f"{base}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/schedstat") as f:
                timeslices = int(f.read().split()[2])
            blocked = blocked_in(pid, tid)
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
        threads[tid] = {
            "name": status["Name"].strip(),
            "main": tid == str(pid),
            **blocked,
            "voluntary": int(status["voluntary_ctxt_switches"]),
            "involuntary": int(status["nonvoluntary_ctxt_switches"]),
            "timeslices": timeslices,
            "ticks": int(stat[11]) + int(stat[12]),  # utime + stime (fields 14, 15)
        }
    return threads


def anon_breakdown(pid: int) -> dict[str, int]:
    """Where a process's anonymous memory is (KiB by kind of mapping, /proc/PID/smaps): the heap,
    glibc's per-thread malloc arenas (64 MiB-aligned), thread stacks (8 MiB), other anonymous
    mappings (pymalloc's arenas, large objects) and libraries' written data pages."""
    kinds: dict[str, int] = {}
    kind = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                start, end = (int(x, 16) for x in fields[0].split("-"))
                size = end - start
                name = fields[5] if len(fields) > 5 else ""
                if name.startswith("/"):
                    kind = "libraries' data"
                elif name:
                    kind = name  # [heap], [stack], [vvar]...
                elif start % (64 << 20) == 0:  # glibc aligns a thread's arena to its 64 MiB
                    kind = "malloc arenas of threads"
                elif size in (8 << 20, (8 << 20) + 4096):
                    kind = "thread stacks"
                else:
                    kind = "other anonymous (pymalloc arenas, large objects)"
            elif fields[0] == "Anonymous:":
                kinds[kind] = kinds.get(kind, 0) + int(fields[1])
    return {k: v for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v}


def cmd_idle(args: argparse.Namespace) -> int:
    sleeper = subprocess.Popen(["python3", "-c", f"import time; time.sleep({args.window})"])
    deadline = now() + 30
    while now() < deadline:  # the window starts once the sleeper sleeps: its RSS is final
        with open(f"/proc/{sleeper.pid}/syscall") as f:
            if f.read().split()[0] == str(SYS_CLOCK_NANOSLEEP):
                break
        time.sleep(0.01)
    sleeper_rss = _kib(_fields(f"/proc/{sleeper.pid}/status"), "VmRSS")
    requests_before = emulator_requests(args.stats)
    before, t0 = thread_snapshot(args.pid), now()
    sleeper.wait(timeout=args.window + 30)
    after, t1 = thread_snapshot(args.pid), now()
    requests_after = emulator_requests(args.stats)
    status = _fields(f"/proc/{args.pid}/status")
    threads = []
    for tid, end in after.items():
        start = before.get(tid, {"voluntary": 0, "involuntary": 0, "timeslices": 0, "ticks": 0})
        deltas = {k: end[k] - start[k] for k in ("voluntary", "involuntary", "timeslices", "ticks")}
        threads.append({"tid": int(tid), **end, **deltas, "new": tid not in before})
    result = {
        "window_s": t1 - t0,
        "rss_kib": _kib(status, "VmRSS"),
        "rss_anon_kib": _kib(status, "RssAnon"),
        "rss_file_kib": _kib(status, "RssFile"),
        "anon_kib_by_mapping": anon_breakdown(args.pid),
        "sleeper_rss_kib": sleeper_rss,
        "threads": threads,
        "gone": sorted(set(before) - set(after)),
        "clk_tck": os.sysconf("SC_CLK_TCK"),
        "metadata_requests": None
        if requests_before is None or requests_after is None
        else requests_after - requests_before,
    }
    print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------- peers: driverctl

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


# --------------------------------------------------------------------------- peers: metadata address

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


def emulator_requests(url: str | None) -> int | None:
    if not url:
        return None
    with urllib.request.urlopen(url, timeout=10) as answer:
        return int(json.loads(answer.read())["requests"])


def cmd_unbind(args: argparse.Namespace) -> int:
    for addr in args.addr:
        unbind(addr)
    print(json.dumps({addr: driver_of(addr) for addr in args.addr}))
    return 0


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
