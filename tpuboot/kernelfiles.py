"""Reads of /proc and sysfs files: bounded in size, and refusing what is not a regular file.

Under ``--root`` a FIFO may stand where the kernel has a file (opening it for reading would wait
for a writer) and a file may be any size; on the host another process's entries may vanish or be
refused between two reads. Each reader returns None for all of those, never raises: a scan of a
busy host goes on past a process that exited under it. Reads that can block on another process
(its command line) are also bounded in time, by their caller: :mod:`tpuboot.holders.bounded`.
"""

from __future__ import annotations

import os
import stat

from tpuboot.numbers import ascii_int
from tpuboot.paths import MAX_FILE_BYTES, Root


def read_bytes(root: Root, path: str, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """At most ``limit`` bytes of a /proc (or sysfs) file; None when it vanished, cannot be read
    or is not a regular file."""
    try:
        fd = os.open(root.path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_text(root: Root, path: str, limit: int = MAX_FILE_BYTES) -> str | None:
    """:func:`read_bytes` as text (bytes that are not UTF-8 replaced)."""
    data = read_bytes(root, path, limit)
    return None if data is None else data.decode("utf-8", "replace")


#: Where :func:`stat_fields` has a process's state, its parent's PID and its start time (in clock
#: ticks after boot): /proc/PID/stat's fields 3, 4 and 22.
STATE, PPID, START = 0, 1, 19


def stat_fields(root: Root, pid: int | str) -> list[str] | None:
    """/proc/PID/stat (PID may be ``self``) after the command, which may hold spaces and
    parentheses: field 3 (state) onwards, so ``[START]`` is the start time in clock ticks after boot;
    None unless the parent PID and the start time are ASCII digits, as the kernel writes them."""
    text = read_text(root, f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    fields = text.rpartition(")")[2].split()
    if len(fields) <= START or ascii_int(fields[PPID]) is None or ascii_int(fields[START]) is None:
        return None
    return fields


def start_ticks(root: Root, pid: int | str) -> int | None:
    """The process's start time in clock ticks after boot (PID may be ``self``): with the PID, what
    names one process (a PID reused between a scan and a kill has another)."""
    fields = stat_fields(root, pid)
    return None if fields is None else int(fields[START])  # ASCII digits: stat_fields checked them
