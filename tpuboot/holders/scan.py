"""Which processes have given device nodes open: one pass over /proc/*/fd.

An fd matches a node by its link text (``/dev/vfio/12``, or ``/dev/vfio/12 (deleted)`` once the
node was removed, as after an unbind) and, on the running host, by device number (st_rdev, from
stat of the fd itself): a container's node may have another name in its mount namespace, but the
same number. Under ``--root`` the links' text names the tree's host paths, so the text is compared
as it is (never mapped under the root), and no fd is stat'ed: that would follow the link into this
host's /dev. Only device fds are stat'ed (their text starts with /dev/ or says deleted), so a scan
costs one readlink per fd: the price `fuser` pays too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

from tpuboot.paths import Root

DELETED = " (deleted)"


@dataclass
class Opened:
    """The scan's result: each PID with the wanted nodes it has open, and whom it could not read."""

    nodes: dict[int, set[str]] = field(default_factory=dict)
    unreadable: list[int] = field(default_factory=list)  # PIDs whose fds were refused (EACCES)
    processes: int = 0  # PIDs looked at

    def holders_of(self, node: str) -> list[int]:
        return sorted(pid for pid, held in self.nodes.items() if node in held)


def device_numbers(root: Root, nodes: Iterable[str]) -> dict[int, str]:
    """st_rdev of each node that is a character device on the running host; {} under --root."""
    numbers: dict[int, str] = {}
    if not root.is_host:
        return numbers
    for node in nodes:
        try:
            st = os.stat(node)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev:
            numbers[st.st_rdev] = node
    return numbers


def _by_number(fd: str, dir_fd: int, numbers: dict[int, str]) -> str | None:
    try:
        st = os.stat(fd, dir_fd=dir_fd)
    except OSError:
        return None
    return numbers.get(st.st_rdev) if stat.S_ISCHR(st.st_mode) else None


def scan(root: Root, nodes: Iterable[str]) -> Opened:
    """Every process with one of ``nodes`` open. A process that exits mid-scan is skipped; one
    whose fds cannot be read (another user's, without root) is listed in ``unreadable``."""
    wanted = set(nodes)
    numbers = device_numbers(root, wanted)
    found = Opened()
    proc = str(root.path("/proc"))
    try:
        names = os.listdir(proc)
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        found.processes += 1
        try:
            held = _held(f"{proc}/{name}/fd", wanted, numbers)
        except PermissionError:
            found.unreadable.append(int(name))
            continue
        except OSError:  # gone, or not a process directory
            continue
        if held:
            found.nodes[int(name)] = held
    return found


def _held(fd_dir: str, wanted: set[str], numbers: dict[int, str]) -> set[str]:
    """The wanted nodes among one process's fds. Its fd directory is opened once and each link
    read relative to it: no path walk through /proc per fd."""
    dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    held: set[str] = set()
    try:
        for fd in os.listdir(dir_fd):
            try:
                target = os.readlink(fd, dir_fd=dir_fd)
            except OSError:
                continue
            if target.endswith(DELETED):
                target = target[: -len(DELETED)]
            elif not target.startswith("/dev/"):
                continue
            if target in wanted:
                held.add(target)
            elif numbers:
                node = _by_number(fd, dir_fd, numbers)
                if node is not None:
                    held.add(node)
    finally:
        os.close(dir_fd)
    return held
