"""An idle process, measured (``idle``): per-thread wakeups and the calls they sleep in, CPU ticks,
RSS and its anonymous part, the metadata emulator's requests of the window, and each wake-up of
the process's threads with its time and its cause (the kernel's ``sched:sched_wakeup`` events):
what woke a thread from outside the process (a timer or a packet, in interrupt context, or another
process) tells a wake-up of the process from a handoff between its own threads."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
from typing import Any

from common import now

SYS_CLOCK_NANOSLEEP = 230  # x86_64
# x86_64 numbers of the calls an idle thread blocks in; the value says where its fd argument is.
SYS_CALLS: dict[int, tuple[str, str | None]] = {
    0: ("read", "fd"), 7: ("poll", "pollfd"), 23: ("select", None), 45: ("recvfrom", "fd"),
    47: ("recvmsg", "fd"), 61: ("wait4", None), 202: ("futex", None), 230: ("clock_nanosleep", None),
    232: ("epoll_wait", "fd"), 270: ("pselect6", None), 271: ("ppoll", "pollfd"), 281: ("epoll_pwait", "fd"),
}  # fmt: skip


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


TRACING = "/sys/kernel/tracing"
WAKEUP_EVENT = f"{TRACING}/events/sched/sched_wakeup/enable"
#: A line of the trace: ``<idle>-0 [001] d.h1. 1234.567890: sched_wakeup: comm=python3 pid=174 prio=120 ...``:
#: the task running when the wake-up happened, its flags (``h``/``s``: in a hard or soft interrupt,
#: so not that task's doing), the time and the woken thread.
WAKEUP_LINE = re.compile(
    r"^\s*.+?-(?P<by>\d+)\s+\[\d+\]\s+(?P<flags>\S+)\s+(?P<t>\d+\.\d+): "
    r"sched_wakeup: .*?\bpid=(?P<tid>\d+) prio="
)
IRQ_FLAGS = frozenset("hsHzZ")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class WakeupTrace:
    """Every ``sched_wakeup`` of the guest while the block runs, kept for the threads asked for."""

    def __enter__(self) -> WakeupTrace:
        if not os.path.exists(f"{TRACING}/trace"):
            subprocess.run(["mount", "-t", "tracefs", "nodev", TRACING], check=True)
        _write(f"{TRACING}/tracing_on", "0")
        _write(f"{TRACING}/trace", "")  # empties the buffer
        _write(f"{TRACING}/buffer_size_kb", "8192")  # per CPU: a minute of an idle guest's wake-ups
        _write(WAKEUP_EVENT, "1")
        _write(f"{TRACING}/tracing_on", "1")
        return self

    def __exit__(self, *exc: object) -> None:
        _write(f"{TRACING}/tracing_on", "0")
        with open(f"{TRACING}/trace") as f:
            self.lines = f.read().splitlines()
        _write(WAKEUP_EVENT, "0")
        _write(f"{TRACING}/trace", "")

    def of(self, tids: set[int]) -> list[dict[str, Any]]:
        """The wake-ups of ``tids`` in time order: time (s), woken thread, the task running then
        and whether it ran in an interrupt (a timer, a packet) rather than that task."""
        found = []
        for line in self.lines:
            match = WAKEUP_LINE.match(line)
            if match and int(match["tid"]) in tids:
                irq = bool(IRQ_FLAGS & set(match["flags"]))
                found.append(
                    {"t": float(match["t"]), "tid": int(match["tid"]), "by": int(match["by"]), "irq": irq}
                )
        return found


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
    with WakeupTrace() as trace:
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
        "wakeups": trace.of({int(tid) for tid in (*before, *after)}),
        "clk_tck": os.sysconf("SC_CLK_TCK"),
        "metadata_requests": None
        if requests_before is None or requests_after is None
        else requests_after - requests_before,
    }
    print(json.dumps(result))
    return 0


def emulator_requests(url: str | None) -> int | None:
    if not url:
        return None
    with urllib.request.urlopen(url, timeout=10) as answer:
        return int(json.loads(answer.read())["requests"])
