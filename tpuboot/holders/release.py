"""`tpuboot release`: the safe part of what people do by hand.

A lock file is removed only while tpuboot itself holds its lock: a libtpu that opened the file
just before the unlink then fails to lock it and says the TPU is busy, instead of locking an
orphaned file while the next libtpu creates a new one (two holders of one TPU). A held file is
never removed. /tmp is any user's: the removal follows no link at any component (each directory
opened with ``O_NOFOLLOW`` from the root down), opens the file relative to its directory, checks
it is the very file the scan saw (device and inode), and unlinks the name through the directory
only while it still names that file, so a file swapped in since the scan is never removed. (In
sticky /tmp only the file's owner could swap the name between that check and the unlink, and
only for a file of their own.) A process holding a VFIO device that cannot be tied to a chip is
named but never ended: it may be another VFIO user's. Holders are ended only with ``--kill``:
SIGTERM (with SIGCONT, so a stopped one can act on it), then SIGKILL after a bounded wait; each
through a pidfd opened before the start time is checked again, so a PID reused since the scan is
never signalled. tpuboot, PID 1,
the agents tpuboot supervises (any container it made, or an agent's program under the exec
runtime: :mod:`tpuboot.holders.supervised`) and a process holding only /dev/vfio/vfio (which a
user of any other VFIO device holds too) are never ended.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import stat
import time

from tpuboot.devices.chips import VFIO_CONTAINER
from tpuboot.errors import printable
from tpuboot.holders.locks import LockFile
from tpuboot.holders.procfs import Process, running
from tpuboot.holders.report import Report, describe, lock_holder
from tpuboot.holders.supervised import Supervised
from tpuboot.kernelfiles import start_ticks
from tpuboot.paths import Root

#: Seconds between SIGTERM and SIGKILL, and after SIGKILL before giving up on a process.
TERM_GRACE = 5.0
KILL_WAIT = 2.0
#: How often a process without a pidfd is looked at, while it is given time to end.
GONE_POLL = 0.1


def is_tpuboot(p: Process) -> bool:
    words = p.command.split()
    if not words:
        return False
    if words[0].rsplit("/", 1)[-1] == "tpuboot":
        return True
    return words[0].rsplit("/", 1)[-1].startswith("python") and (
        words[1:3] == ["-m", "tpuboot"] or (len(words) > 1 and words[1].rsplit("/", 1)[-1] == "tpuboot")
    )


def protected(p: Process, agents: Supervised) -> str | None:
    """Why ``p`` is never ended, or None."""
    if p.pid == os.getpid() or p.pid == 1:
        return "tpuboot itself" if p.pid != 1 else "PID 1"
    if is_tpuboot(p):
        return "tpuboot"
    return agents.reason(p)


# --- lock files --------------------------------------------------------------------------------


def remove_unheld(root: Root, lock: LockFile, dry_run: bool) -> str:
    """Remove ``lock`` if nobody holds it, holding its lock while unlinking; one line of outcome."""
    path, owner = printable(lock.path), printable(lock.owner)
    if lock.held:
        return f"kept {path}: held by {lock_holder(lock)}"
    if dry_run:
        return f"would remove {path} (owner {owner}, not held)"
    directory, _, name = lock.path.rpartition("/")
    try:
        dir_fd = _open_directory(root, directory)
    except FileNotFoundError:
        return f"{path} is gone already"
    except OSError as exc:
        return f"kept {path}: its directory cannot be opened without following a link ({exc.strerror})"
    try:
        return _remove_locked(dir_fd, name, lock, path, owner)
    finally:
        os.close(dir_fd)


def _open_directory(root: Root, directory: str) -> int:
    """``directory`` (absolute, under ``root``) opened one component at a time, no link followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root.prefix, flags)
    try:
        for part in [p for p in directory.split("/") if p]:
            if part == "..":
                raise OSError(errno.EINVAL, "a '..' component")
            fd, parent = os.open(part, flags, dir_fd=fd), fd
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_locked(dir_fd: int, name: str, lock: LockFile, path: str, owner: str) -> str:
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return f"{path} is gone already"
    except OSError as exc:
        return f"cannot remove {path}: {exc.strerror} (run as root)"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (lock.device, lock.inode):
            return f"kept {path}: it is another file than the one looked at (replaced since the scan)"
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return f"kept {path}: locked since the scan"
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return f"{path} is gone already"
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return f"kept {path}: its name was given to another file since the scan"
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError as exc:
            return f"cannot remove {path}: {exc.strerror} (run as root)"
    finally:
        os.close(fd)
    return f"removed {path} (owner {owner}, not held)"


# --- ending holders ----------------------------------------------------------------------------


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` where the kernel (5.3+) and Python have them; None otherwise or if gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:
        return None
    return fd


def _signal(pidfd: int | None, pid: int, sig: int) -> None:
    sender = getattr(signal, "pidfd_send_signal", None)
    with contextlib.suppress(ProcessLookupError):
        if pidfd is not None and sender is not None:  # not reused: the pidfd names one process
            sender(pidfd, sig)
        else:
            os.kill(pid, sig)


def _gone(root: Root, p: Process, pidfd: int | None, seconds: float) -> bool:
    """True once ``p`` exits within ``seconds``: its pidfd readable, else it is gone, a zombie, or
    its PID another process's."""
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(int(seconds * 1000)))
    deadline = time.monotonic() + seconds
    while True:
        if not running(root, p.pid, p.start_ticks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(GONE_POLL)


def end(root: Root, p: Process, grace: float = TERM_GRACE) -> str:
    """SIGTERM, then SIGKILL after ``grace`` seconds: one line saying what became of ``p``."""
    if p.state == "zombie":
        return f"PID {p.pid} is a zombie: its parent, PID {p.ppid}, must reap it (end or restart the parent)"
    pidfd = _pidfd(p.pid)
    try:
        if start_ticks(root, p.pid) != p.start_ticks:
            was = printable(p.command)
            return f"PID {p.pid} is no longer {was} (it exited, or its PID was reused): left alone"
        _signal(pidfd, p.pid, signal.SIGTERM)
        _signal(pidfd, p.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        if _gone(root, p, pidfd, grace):
            return f"PID {p.pid} ended on SIGTERM"
        _signal(pidfd, p.pid, signal.SIGKILL)
        if _gone(root, p, pidfd, KILL_WAIT):
            return f"PID {p.pid} ended on SIGKILL after {grace:g} s"
        return f"PID {p.pid} is still there after SIGKILL ({p.state}: it ends when the kernel lets it)"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def release(root: Root, report: Report, agents: Supervised, *, dry_run: bool, kill: bool) -> list[str]:
    """Remove unheld lock files; report holders; end them with ``kill``. One line per action."""
    lines = [remove_unheld(root, lock, dry_run) for lock in report.locks]
    ours = report.chip_pids() | {lock.holder.pid for lock in report.locks if lock.holder}
    known = {h.process.pid for c in report.chips for h in c.holders}
    unknown = {h.process.pid for h in report.unknown} - known
    for p in report.processes():
        why = protected(p, agents)
        if why is None and p.pid in unknown:
            why = (
                "it holds a VFIO or accel device tied to no chip, maybe another VFIO user's; end it yourself"
            )
        if why is None and p.pid not in ours:  # any VFIO user opens it, a VM's device too
            why = f"it holds {VFIO_CONTAINER} only, which users of other VFIO devices open too"
        if why is not None:
            lines.append(f"left alone: {describe(p)} ({why})")
        elif not kill:
            lines.append(f"holder: {describe(p)} (--kill ends it)")
        elif dry_run:
            lines.append(f"would end: {describe(p)}")
        else:
            lines.append(end(root, p))
    lines += [f"not seen: {phrase}" for phrase in report.unseen.phrases()]
    return lines or ["nothing holds a chip and there is no libtpu lock file"]
