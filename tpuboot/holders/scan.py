"""Which processes hold what :mod:`tpuboot.holders.targets` looks for: one pass over /proc/*/fd.

On the running host each fd that names a file is stat'ed (through the fd itself, so a name in
another mount namespace does not matter) and matched by device number; sockets, pipes and
anonymous inodes other than VFIO device fds are skipped by their text, which only the kernel
writes. Under ``--root`` the links' text is matched as it is (never mapped under the root, and
never stat'ed: that would follow the link into this host's /dev). A node that was removed (after
an unbind) reads ``... (deleted)`` and still counts.

A stat or fdinfo read can block on the process's files (a FUSE server that never answers): each
process is read under :func:`tpuboot.holders.bounded.each_within`, and one that did not answer,
like one whose fds could not be read (another user's, without root) or one the scan did not
reach, is listed as not seen: never as holding nothing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from tpuboot.holders.bounded import each_within
from tpuboot.holders.targets import SYSPATH_FIELD, VFIO_DEVICE_FD, Targets
from tpuboot.kernelfiles import read_text
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root

DELETED = " (deleted)"


@dataclass
class Held:
    """One process's fds of interest: the keys it holds, and what it holds of no known chip."""

    keys: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)  # why: one phrase per fd kind


@dataclass(frozen=True)
class Unseen:
    """What a scan could not see: each could hide a holder of any chip."""

    unreadable: tuple[int, ...] = ()  # PIDs whose open files could not be read (not root)
    unanswered: tuple[int, ...] = ()  # PIDs whose reads blocked (a stuck process, a dead FUSE server)
    not_reached: tuple[int, ...] = ()  # PIDs the scan had no time for
    listed: bool = True  # /proc could be listed at all
    hidden: bool = False  # /proc hides other users' processes from this one (hidepid)

    def __bool__(self) -> bool:
        return bool(self.unreadable or self.unanswered or self.not_reached or not self.listed or self.hidden)

    def phrases(self) -> list[str]:
        """What was not seen, one phrase each, with what to do."""
        said = []
        if not self.listed:
            said.append("/proc could not be listed, so no process was seen")
        if self.hidden:
            said.append(
                "/proc hides other users' processes (hidepid) from this user (run as root to see them)"
            )
        if self.unreadable:
            said.append(f"{_pids(self.unreadable)} could not be read (run as root to see them)")
        if self.unanswered:
            said.append(
                f"{_pids(self.unanswered)} did not answer (stuck in the kernel, or a file server that hangs)"
            )
        if self.not_reached:
            said.append(f"{_pids(self.not_reached)} were not reached in the scan's time")
        return said

    def as_dict(self) -> dict[str, object]:
        return {
            "unreadable_pids": list(self.unreadable),
            "unanswered_pids": list(self.unanswered),
            "not_reached_pids": list(self.not_reached),
            "proc_listed": self.listed,
            "proc_hides_processes": self.hidden,
        }


def _pids(pids: Sequence[int]) -> str:
    listed = ", ".join(str(pid) for pid in pids[:5]) + (f" and {len(pids) - 5} more" if len(pids) > 5 else "")
    return f"the open files of {len(pids)} process{'es' if len(pids) != 1 else ''} (PID {listed})"


@dataclass
class Opened:
    """The scan's result: each PID with what it holds, and whom it could not see."""

    nodes: dict[int, set[str]] = field(default_factory=dict)
    unknown: dict[int, set[str]] = field(default_factory=dict)  # PID -> fds of an unknown chip
    unreadable: list[int] = field(default_factory=list)  # PIDs whose fds were refused (EACCES)
    unanswered: list[int] = field(default_factory=list)  # PIDs whose reads blocked
    not_reached: list[int] = field(default_factory=list)  # PIDs the scan had no time for
    listed: bool = True  # /proc could be listed
    hidden: bool = False  # /proc hides other users' processes from this one (hidepid)
    processes: int = 0  # PIDs looked at

    def holders_of(self, node: str) -> list[int]:
        return sorted(pid for pid, held in self.nodes.items() if node in held)

    def unseen(self) -> Unseen:
        """What the scan could not see."""
        return Unseen(
            tuple(self.unreadable), tuple(self.unanswered), tuple(self.not_reached), self.listed, self.hidden
        )


class _Refused:
    """A process's fds could not be read (EACCES): not seen."""


def scan(root: Root, targets: Targets) -> Opened:
    """Every process holding one of ``targets``, and every process the scan could not see."""
    found = Opened()
    proc = str(root.path("/proc"))
    try:
        pids = [n for n in (ascii_int(name) for name in os.listdir(proc)) if n is not None]
    except OSError:
        found.listed = False
        return found
    found.processes = len(pids)
    found.hidden = root.is_host and os.geteuid() != 0 and hides_processes(root)

    def look(pid: int) -> Held | _Refused | None:
        try:
            return _held(root, proc, pid, targets)
        except PermissionError:
            return _Refused()
        except OSError:  # gone, or not a process directory
            return None

    outcome = each_within(pids, look)
    for pid, held in outcome.results.items():
        if isinstance(held, _Refused):
            found.unreadable.append(pid)
        elif held is not None and held.keys:
            found.nodes[pid] = held.keys
        if isinstance(held, Held) and held.unknown:
            found.unknown[pid] = held.unknown
    found.unanswered = sorted(outcome.unanswered)
    found.not_reached = sorted(outcome.not_reached)
    found.unreadable.sort()
    return found


def hides_processes(root: Root) -> bool:
    """/proc is mounted with ``hidepid`` (1, 2, invisible, noaccess, ptraceable): other users'
    processes are then left out of a listing, not refused, and only root sees them all."""
    for line in (read_text(root, "/proc/self/mountinfo") or "").splitlines():
        fields = line.split(" - ")
        before, after = fields[0].split(), fields[-1].split()
        if len(before) > 4 and before[4] == "/proc" and after[:1] == ["proc"]:
            options = after[2].split(",") if len(after) > 2 else []
            return any(o.startswith("hidepid=") and o not in ("hidepid=0", "hidepid=off") for o in options)
    return False


def _held(root: Root, proc: str, pid: int, targets: Targets) -> Held:
    """What one process holds. Its fd directory is opened once and each fd looked at relative to
    it: no path walk through /proc per fd."""
    dir_fd = os.open(f"{proc}/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    held = Held()
    look = _by_number if root.is_host else _by_text
    try:
        for fd in os.listdir(dir_fd):
            look(root, pid, fd, dir_fd, targets, held)
    finally:
        os.close(dir_fd)
    return held


def _by_number(root: Root, pid: int, fd: str, dir_fd: int, targets: Targets, held: Held) -> None:
    """The host: one stat of what the fd has open (through the fd, whatever its name there);
    its link is read only for a character device of no chip and an anonymous inode (a VFIO
    device fd's, or a socket's, an eventfd's...), which have no file type bits."""
    try:
        st = os.stat(fd, dir_fd=dir_fd)
    except OSError:
        return
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFCHR:
        key = targets.by_number.get(st.st_rdev)
        if key is not None:
            held.keys.add(key)
        elif os.major(st.st_rdev) in targets.majors and st.st_rdev not in targets.others:
            number = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            held.unknown.add(
                f"{_link(fd, dir_fd)} (char {number}), a VFIO or accel device of no chip present"
            )
    elif kind == 0 and _link(fd, dir_fd) == VFIO_DEVICE_FD:
        _device_fd(root, pid, fd, targets, held)


def _link(fd: str, dir_fd: int) -> str:
    try:
        return os.readlink(fd, dir_fd=dir_fd)
    except OSError:
        return "?"


def _by_text(root: Root, pid: int, fd: str, dir_fd: int, targets: Targets, held: Held) -> None:
    """A --root tree: the link's text, as it is."""
    try:
        target = os.readlink(fd, dir_fd=dir_fd)
    except OSError:
        return
    if target == VFIO_DEVICE_FD:
        _device_fd(root, pid, fd, targets, held)
        return
    name = target[: -len(DELETED)] if target.endswith(DELETED) else target
    key = targets.by_text.get(name)
    if key is not None:
        held.keys.add(key)
    elif name.startswith(("/dev/vfio/", "/dev/accel")) and name not in targets.other_texts:
        held.unknown.add(f"{target}, a VFIO or accel device of no chip present")


def _device_fd(root: Root, pid: int, fd: str, targets: Targets, held: Held) -> None:
    """A VFIO device fd: its chip by the device its fdinfo names; unknown where it names none."""
    info = read_text(root, f"/proc/{pid}/fdinfo/{fd}", 4096) or ""
    syspath = next(
        (line[len(SYSPATH_FIELD) :].strip() for line in info.splitlines() if line.startswith(SYSPATH_FIELD)),
        None,
    )
    if syspath is None:
        held.unknown.add(f"{VFIO_DEVICE_FD} (this kernel does not say of which device)")
        return
    address = syspath.rstrip("/").rpartition("/")[2]
    key = targets.by_address.get(address)
    if key is not None:
        held.keys.add(key)
    elif address not in targets.addresses:
        held.unknown.add(f"{VFIO_DEVICE_FD} of {address}, a device not present")
