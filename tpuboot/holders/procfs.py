"""One process's facts, read from /proc under the injectable root.

A process may vanish between any two reads, and another user's may be unreadable: each reader
returns None (or an empty value) rather than raising, so a scan of a busy host never fails on a
process that exited under it.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import asdict, dataclass

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

# Container ids in cgroup paths: docker (systemd and cgroupfs drivers), containerd's CRI, podman;
# a container may have cgroups of its own below its scope (podman's /container).
_CONTAINER = (
    (re.compile(r"/docker-([0-9a-f]{64})\.scope(?:/|$)"), "docker"),
    (re.compile(r"/docker/([0-9a-f]{64})(?:/|$)"), "docker"),
    (re.compile(r"/cri-containerd-([0-9a-f]{64})\.scope(?:/|$)"), "containerd"),
    (re.compile(r"/libpod-([0-9a-f]{64})\.scope(?:/|$)"), "podman"),
)
_UNIT_SUFFIXES = (".service", ".scope")


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


def read_text(root: Root, path: str) -> str | None:
    """A /proc file's text; None when it vanished or cannot be read."""
    try:
        with open(root.path(path), "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def stat_fields(root: Root, pid: int) -> list[str] | None:
    """/proc/PID/stat after the command (which may hold spaces and parentheses): field 3 onwards."""
    text = read_text(root, f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    return text.rpartition(")")[2].split()


def start_ticks(root: Root, pid: int) -> int | None:
    """The process's start time in clock ticks after boot: with the PID, what names one process
    (a PID reused between a scan and a kill has another)."""
    fields = stat_fields(root, pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def running(root: Root, pid: int, ticks: int) -> bool:
    """``pid`` is still the process that started at ``ticks`` and has not exited (a zombie has: it
    holds no files)."""
    fields = stat_fields(root, pid)
    try:
        return fields is not None and int(fields[19]) == ticks and fields[0] not in ("Z", "X")
    except (IndexError, ValueError):
        return False


def boot_time(root: Root) -> float | None:
    text = read_text(root, "/proc/stat") or ""
    match = re.search(r"^btime (\d+)$", text, re.M)
    return float(match.group(1)) if match else None


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
        units = [part for part in path.split("/") if part.endswith(_UNIT_SUFFIXES)]
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
            if len(parts) > 2 and parts[2].isdigit():
                self.names.setdefault(int(parts[2]), parts[0])

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

    def process(self, pid: int) -> Process | None:
        """Everything `who` shows of ``pid``; None when it is gone."""
        fields = stat_fields(self.root, pid)
        if fields is None or len(fields) < 20:
            return None
        status = status_fields(self.root, pid)
        uid = int((status.get("Uid") or "-1").split()[0])
        unit, container, engine = where_from_cgroup(read_text(self.root, f"/proc/{pid}/cgroup") or "")
        nspid = (status.get("NSpid") or "").split()
        inner = int(nspid[-1]) if len(nspid) > 1 and nspid[-1].isdigit() else None
        started = self.boot + int(fields[19]) / self.ticks if self.boot is not None else None
        return Process(
            pid=pid,
            ppid=int(fields[1]),
            uid=uid,
            user=self.users.name(uid),
            command=self.command(pid, status.get("Name", "?")),
            state=STATES.get(fields[0], fields[0]),
            started=started,
            start_ticks=int(fields[19]),
            unit=unit,
            container=container,
            engine=engine,
            pid_namespace=self.namespace(pid),
            namespace_pid=inner,
        )

    def command(self, pid: int, name: str) -> str:
        """Its command line, or ``[name]`` for a zombie or kernel thread (which have none)."""
        raw = read_text(self.root, f"/proc/{pid}/cmdline") or ""
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
    soft = line[len("Max locked memory") :].split()[0]
    caps = status_fields(root, pid).get("CapEff", "0")
    try:
        has = bool(int(caps, 16) >> CAP_IPC_LOCK & 1)
    except ValueError:
        has = False
    return Memlock(soft, has)
