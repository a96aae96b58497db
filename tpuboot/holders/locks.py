"""libtpu's lock files and who holds them.

libtpu opens ``/tmp/libtpu_lockfile`` (mode 0600) and takes ``lockf(F_TLOCK)`` on it (openxla/xla,
``xla/stream_executor/tpu/tpu_initialize_util.cc``); the kernel drops the lock when the process
dies, so a file nobody holds is harmless to its owner and blocks everyone else (0600). Builds
that keep the lock elsewhere use a per-user name beside it or a directory of their own under /tmp:
every ``/tmp/libtpu*lock*`` file, and every ``*lock*`` file in a ``/tmp/libtpu*`` directory, is
looked at. The holder is the PID /proc/locks names for the file's device and inode, whatever
process that is.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from tpuboot.holders.procfs import Process, ProcReader
from tpuboot.kernelfiles import read_text
from tpuboot.numbers import ascii_hex, ascii_int
from tpuboot.paths import Root

LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
TMP = "/tmp"
LIBTPU_PREFIX = "libtpu"

#: (major, minor, inode) of a locked file -> the PID holding it (None: an OFD lock, no PID).
LockTable = dict[tuple[int, int, int], int | None]


@dataclass(frozen=True)
class LockFile:
    """One lock file: its owner and mode, and the process holding its lock (None: not held)."""

    path: str
    uid: int
    owner: str
    mode: str
    held: bool
    holder_pid: int | None  # as /proc/locks names it (None for an OFD lock or when not held)
    holder: Process | None  # that process, if it could be read
    device: int = 0  # st_dev and st_ino as scanned: a file put in its place since is another
    inode: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "uid": self.uid,
            "owner": self.owner,
            "mode": self.mode,
            "held": self.held,
            "holder_pid": self.holder_pid,
            "holder": self.holder.as_dict() if self.holder else None,
        }


def lock_paths(root: Root) -> list[str]:
    """The libtpu lock files present, fixed path first."""
    found: list[str] = []
    try:
        entries = sorted(os.scandir(root.path(TMP)), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        if not entry.name.startswith(LIBTPU_PREFIX):
            continue
        path = f"{TMP}/{entry.name}"
        if entry.is_file(follow_symlinks=False) and "lock" in entry.name:
            found.append(path)
        elif entry.is_dir(follow_symlinks=False):
            found += _locks_in(root, path)
    return sorted(found, key=lambda p: (p != LIBTPU_LOCKFILE, p))


def _locks_in(root: Root, directory: str) -> list[str]:
    try:
        entries = list(os.scandir(root.path(directory)))
    except OSError:
        return []
    return sorted(
        f"{directory}/{e.name}" for e in entries if "lock" in e.name and e.is_file(follow_symlinks=False)
    )


def lock_table(root: Root) -> LockTable:
    """/proc/locks as {(major, minor, inode): pid}; waiters (``->``) are not holders."""
    table: LockTable = {}
    for line in (read_text(root, "/proc/locks") or "").splitlines():
        words = line.split()
        if len(words) < 6 or words[1] == "->":
            continue
        parts = words[5].split(":")
        numbers = (ascii_hex(parts[0]), ascii_hex(parts[1]), ascii_int(parts[2])) if len(parts) == 3 else ()
        pid = -1 if words[4] == "-1" else ascii_int(words[4])  # -1: an OFD lock, which has no PID
        if len(numbers) != 3 or None in numbers or pid is None:
            continue
        major, minor, inode = (n for n in numbers if n is not None)
        table.setdefault((major, minor, inode), pid if pid > 0 else None)
    return table


@dataclass(frozen=True)
class Locked:
    """The lock files present and /proc/locks as one scan saw them: the PIDs to read first."""

    files: tuple[tuple[str, os.stat_result], ...]
    table: LockTable

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, int, int]:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)

    def holder_pids(self) -> set[int]:
        pids = (self.table.get(self._key(st)) for _, st in self.files)
        return {pid for pid in pids if pid is not None}

    def described(self, reader: ProcReader, holders: dict[int, Process]) -> list[LockFile]:
        """Each file with its owner, mode and holder; ``holders`` has the processes already read
        (one read of each process per scan, whether it holds a chip, a lock or both)."""
        found = []
        for path, st in self.files:
            key = self._key(st)
            pid = self.table.get(key)
            holder = holders.get(pid) if pid is not None else None
            mode = f"{stat.S_IMODE(st.st_mode):04o}"
            owner = reader.users.name(st.st_uid)
            found.append(
                LockFile(path, st.st_uid, owner, mode, key in self.table, pid, holder, st.st_dev, st.st_ino)
            )
        return found


def locked(root: Root, table: LockTable | None = None) -> Locked:
    """The libtpu lock files present and which PID holds each (not yet who that process is)."""
    table = lock_table(root) if table is None else table
    files = []
    for path in lock_paths(root):
        try:
            files.append((path, os.lstat(root.path(path, follow=False))))
        except OSError:
            continue  # removed meanwhile
    return Locked(tuple(files), table)
