"""Which processes hold a TCP port of this host: /proc/net/tcp{,6} give each socket's inode, and
a process's fd that links to ``socket:[INODE]`` names its holder (what ``ss -p`` does).

/proc/net/tcp shows the sockets of the reader's network namespace: run inside the host's (or a
test's) namespace, it sees what a job started there would collide with.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tpuboot.kernelfiles import read_text
from tpuboot.paths import Root

#: /proc/net/tcp's ``st`` of a socket that holds its port against a job's bind: LISTEN (0A), and
#: CLOSE (07), bound and not listening. A connection (01 and the rest) is matched by its local
#: port too, but a listener's accepted connections carry its port already and an outgoing one an
#: ephemeral port: neither is asked about.
_HOLDING = {"0A", "07"}


def port_inodes(root: Root, ports: Iterable[int]) -> dict[int, set[int]]:
    """Each of ``ports`` that a listening socket holds, with those sockets' inodes."""
    wanted = set(ports)
    found: dict[int, set[int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read_text(root, table) or "").splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] not in _HOLDING:
                continue
            try:
                port, inode = int(fields[1].rsplit(":", 1)[1], 16), int(fields[9])
            except (IndexError, ValueError):
                continue
            if port in wanted and inode:
                found.setdefault(port, set()).add(inode)
    return found


def socket_owners(root: Root, inodes: set[int]) -> dict[int, set[int]]:
    """Each inode of ``inodes`` with the PIDs that have it open (a process gone mid-scan is skipped)."""
    links = {f"socket:[{inode}]": inode for inode in inodes}
    owners: dict[int, set[int]] = {}
    if not links:
        return owners
    proc = str(root.path("/proc"))
    try:
        names = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return owners
    for name in names:
        try:
            fds = os.listdir(f"{proc}/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                inode = links.get(os.readlink(f"{proc}/{name}/fd/{fd}"))
            except OSError:
                continue
            if inode is not None:
                owners.setdefault(inode, set()).add(int(name))
    return owners


def port_holders(root: Root, ports: Iterable[int]) -> dict[int, list[int]]:
    """Each port of ``ports`` something listens on, with the PIDs holding it ([] if none could be
    named: another namespace's process, or no permission to read its fds)."""
    inodes = port_inodes(root, ports)
    owners = socket_owners(root, set().union(*inodes.values()) if inodes else set())
    return {port: sorted({pid for i in held for pid in owners.get(i, ())}) for port, held in inodes.items()}
