"""One process's facts, read from /proc under the injectable root.

A process may vanish between any two reads, and another user's may be unreadable: each reader
returns None (or an empty value) rather than raising, so a scan of a busy host never fails on a
process that exited under it. Every read is bounded in size and refuses what is not a regular
file (under ``--root`` a FIFO may stand where /proc has a file: opening it would wait for a
writer); every number is ASCII digits (:mod:`tpuboot.numbers`), as the kernel writes it. Reads
that can block on the process itself (``cmdline``) run under :mod:`tpuboot.holders.bounded`.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tpuboot.config import UNIT_SUFFIXES
from tpuboot.holders.bounded import each_within
from tpuboot.kernelfiles import PPID, START, STATE, read_text, stat_fields
from tpuboot.numbers import ascii_hex, ascii_int
from tpuboot.paths import Root

#: /proc/PID/stat's state letters, as `who` names them (t: stopped by a tracer; I: an idle kernel thread).
STATES = {
    "R": "running",
    "S": "sleeping",
    "I": "sleeping",
    "D": "uninterruptible",
    "T": "stopped",
    "t": "stopped",
    "Z": "zombie",
    "X": "dead",
}
#: The states in which a holder will not let go by itself: doctor FAILs on a chip they hold.
STUCK = ("stopped", "zombie", "uninterruptible")
CAP_IPC_LOCK = 14
UNLIMITED = "unlimited"
#: What `who` shows for a command line whose read blocked.
UNANSWERED = "[command line did not answer]"
#: The most of a command line `who` reads and shows (ps shows less); the rest is cut.
CMDLINE_BYTES = 4096

# Container ids in cgroup paths: docker (systemd and cgroupfs drivers), containerd's CRI, podman;
# a container may have cgroups of its own below its scope (podman's /container).
_CONTAINER = (
    (re.compile(r"/docker-([0-9a-f]{64})\.scope(?:/|$)"), "docker"),
    (re.compile(r"/docker/([0-9a-f]{64})(?:/|$)"), "docker"),
    (re.compile(r"/cri-containerd-([0-9a-f]{64})\.scope(?:/|$)"), "containerd"),
    (re.compile(r"/libpod-([0-9a-f]{64})\.scope(?:/|$)"), "podman"),
)


@dataclass(frozen=True)
class Process:
    """A process as `who` reports it."""

    pid: int
    ppid: int
    uid: int
    user: str
    command: str
    state: str
    started: float | None  # unix seconds; None when the boot time is unknown
    start_ticks: int  # clock ticks after boot: with the PID, names this one process
    unit: str | None  # the innermost systemd unit of its cgroup
    container: str | None  # a container id from its cgroup
    engine: str | None  # docker, containerd or podman
    pid_namespace: str | None  # "pid:[4026531836]"
    namespace_pid: int | None  # its PID inside its own namespace, when that is another one

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["started"] = iso(self.started)
        del data["start_ticks"]
        return data

    @property
    def where(self) -> str:
        """Its container or unit, as one phrase."""
        if self.container:
            return f"{self.engine} container {self.container[:12]}"
        return f"unit {self.unit}" if self.unit else "no unit"


def iso(when: float | None) -> str | None:
    if when is None:
        return None
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def running(root: Root, pid: int, ticks: int) -> bool:
    """``pid`` is still the process that started at ``ticks`` and has not exited (a zombie has: it
    holds no files)."""
    fields = stat_fields(root, pid)
    return fields is not None and int(fields[START]) == ticks and fields[STATE] not in ("Z", "X")


def boot_time(root: Root) -> float | None:
    for line in (read_text(root, "/proc/stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "btime":
            seconds = ascii_int(value)
            return None if seconds is None else float(seconds)
    return None


def status_fields(root: Root, pid: int) -> dict[str, str]:
    """/proc/PID/status as {key: value}; {} when gone."""
    text = read_text(root, f"/proc/{pid}/status") or ""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def where_from_cgroup(text: str) -> tuple[str | None, str | None, str | None]:
    """(unit, container id, engine) from /proc/PID/cgroup: the unified line (0::) first."""
    lines = sorted(text.splitlines(), key=lambda line: not line.startswith("0::"))
    for line in lines:
        path = line.split(":", 2)[-1].strip()
        for pattern, engine in _CONTAINER:
            match = pattern.search(path)
            if match:
                return None, match.group(1), engine
        units = [part for part in path.split("/") if part.endswith(UNIT_SUFFIXES)]
        if units:
            return units[-1], None, None
    return None, None, None


class Users:
    """User names from the root's /etc/passwd (under --root, the tree's, not this host's)."""

    def __init__(self, root: Root) -> None:
        self.names: dict[int, str] = {}
        text = read_text(root, "/etc/passwd") or ""
        for line in text.splitlines():
            parts = line.split(":")
            uid = ascii_int(parts[2]) if len(parts) > 2 else None
            if uid is not None:
                self.names.setdefault(uid, parts[0])

    def name(self, uid: int) -> str:
        return self.names.get(uid, str(uid))


class ProcReader:
    """Reads processes of one root; the boot time, clock rate and users are read once."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.boot = boot_time(root)
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.users = Users(root)
        self.own_namespace = self.namespace("self")

    def namespace(self, pid: int | str) -> str | None:
        try:
            return os.readlink(self.root.path(f"/proc/{pid}/ns/pid", follow=False))
        except OSError:
            return None

    def process(self, pid: int, command: bool = True) -> Process | None:
        """Everything `who` shows of ``pid``; None when it is gone. Without ``command`` its command
        line is not read (a read that blocked once: see :mod:`tpuboot.holders.bounded`)."""
        fields = stat_fields(self.root, pid)
        if fields is None:
            return None
        ppid, ticks = int(fields[PPID]), int(fields[START])  # ASCII digits: stat_fields checked them
        status = status_fields(self.root, pid)
        uid = ascii_int(next(iter((status.get("Uid") or "").split()), None))
        unit, container, engine = where_from_cgroup(read_text(self.root, f"/proc/{pid}/cgroup") or "")
        nspid = (status.get("NSpid") or "").split()
        inner = ascii_int(nspid[-1]) if len(nspid) > 1 else None
        started = self.boot + ticks / self.ticks if self.boot is not None else None
        return Process(
            pid=pid,
            ppid=ppid,
            uid=-1 if uid is None else uid,
            user=self.users.name(-1 if uid is None else uid),
            command=self.command(pid, status.get("Name", "?")) if command else UNANSWERED,
            state=STATES.get(fields[STATE], fields[STATE]),
            started=started,
            start_ticks=ticks,
            unit=unit,
            container=container,
            engine=engine,
            pid_namespace=self.namespace(pid),
            namespace_pid=inner,
        )

    def processes(self, pids: Iterable[int]) -> dict[int, Process]:
        """:meth:`process` of each of ``pids`` that is still there, its command line read under a
        time bound (the read that can block); one whose command line did not answer is shown
        without it."""
        outcome = each_within(sorted(set(pids)), self.process)
        found = {pid: p for pid, p in outcome.results.items() if p is not None}
        for pid in (*outcome.unanswered, *outcome.not_reached):
            p = self.process(pid, command=False)
            if p is not None:
                found[pid] = p
        return found

    def command(self, pid: int, name: str) -> str:
        """Its command line, or ``[name]`` for a zombie or kernel thread (which have none)."""
        raw = read_text(self.root, f"/proc/{pid}/cmdline", CMDLINE_BYTES) or ""
        words = [w for w in raw.split("\0") if w]
        return " ".join(words) if words else f"[{name}]"


@dataclass(frozen=True)
class Memlock:
    """A process's max locked memory (soft limit) and whether it may exceed it (CAP_IPC_LOCK)."""

    soft: str  # "unlimited" or a number of bytes
    cap_ipc_lock: bool

    @property
    def unlimited(self) -> bool:
        return self.soft == UNLIMITED


def memlock(root: Root, pid: int) -> Memlock | None:
    """``pid``'s memlock limit from /proc/PID/limits and CapEff from its status; None when gone."""
    text = read_text(root, f"/proc/{pid}/limits")
    if text is None:
        return None
    line = next((line for line in text.splitlines() if line.startswith("Max locked memory")), None)
    if line is None:
        return None
    words = line[len("Max locked memory") :].split()
    soft = words[0] if words else ""
    if soft != UNLIMITED and ascii_int(soft) is None:
        return None
    caps = ascii_hex(status_fields(root, pid).get("CapEff"))
    return Memlock(soft, caps is not None and bool(caps >> CAP_IPC_LOCK & 1))
