"""`tpuboot run` in a subprocess as systemd starts it: a notify socket, the metadata emulator's
address, the config in a fake root. For the tests that take the daemon's whole start-up path."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT = 60.0  # imports and the first metadata fetch on a loaded 2-core machine


_HELD: list[int] = []  # descriptors of the port locks this process holds, until it exits


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback TCP port for a server the test cannot ask to bind port 0 (``tpuboot run``'s
    metrics, which refuses 0; a Prometheus server; a vBar stand-in), or one that must refuse every
    connect until the test listens there, reserved for this process's life.

    A port freed after ``bind(0)`` can be taken again by any socket of a test running at the same
    time (pytest-xdist workers, the library-matrix rows): ``bind(0)`` and ``connect()`` both draw
    from the ephemeral range. So the port comes from below that range, where the kernel never
    assigns one, and a lock file taken with ``flock`` keeps any other test process off it.
    """
    low = _ephemeral_range()[0]
    first = max(1024, low - 12000)
    locks = Path(tempfile.gettempdir()) / "tpuboot-test-ports"
    try:
        locks.mkdir()
        locks.chmod(0o1777)  # shared like /tmp: the tests of root and of a user lock the same ports
    except FileExistsError:
        pass
    for port in random.sample(range(first, low), k=min(500, low - first)):
        fd = os.open(locks / str(port), os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write access
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # some other program's fixed port
                os.close(fd)
                continue
        _HELD.append(fd)
        return port
    raise RuntimeError(f"no free loopback port in {first}..{low - 1}")


class RunningDaemon:
    """The subprocess and its notify socket; ``stderr`` is filled in once it has ended."""

    def __init__(self, process: subprocess.Popen[str], notify: socket.socket) -> None:
        self.process = process
        self.notify = notify
        self.stderr = ""

    def receive(self, wanted: str, within: float = START_TIMEOUT) -> list[str]:
        """Notifications until one holding ``wanted``; fails when the daemon exits or time runs out."""
        deadline = time.monotonic() + within
        self.notify.settimeout(0.2)
        seen: list[str] = []
        while not any(wanted in message for message in seen):
            try:
                seen.append(self.notify.recv(4096).decode())
                continue
            except TimeoutError:
                pass
            ended = self.process.poll()
            if ended is not None and "STOPPING" not in wanted:
                raise AssertionError(f"tpuboot run exited ({ended}) before {wanted!r}: {seen}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {wanted!r} from tpuboot run within {within:.0f} s; got {seen}")
        return seen


@contextmanager
def tpuboot_run(
    top: Path,
    config: str,
    metadata_host: str,
    work: Path,
    *,
    env: Mapping[str, str] | None = None,
    nofile: int | None = None,
    stderr: Path | None = None,
) -> Iterator[RunningDaemon]:
    """Start ``tpuboot --root TOP --config /tpuboot.yaml run`` with ``config``; killed if still
    running at exit, its stderr printed (pytest shows it on failure). ``env``: more environment
    (``WATCHDOG_USEC``, as systemd's WatchdogSec= sets it); ``nofile``: its RLIMIT_NOFILE, soft and
    hard (as the unit's LimitNOFILE= sets it); ``stderr``: a file for its stderr rather than a pipe
    read at the end (a long one, as ``PYTHONPROFILEIMPORTTIME`` makes, would fill the pipe)."""
    (top / "tpuboot.yaml").write_text(config)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(work / "notify"))
        environ = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "NOTIFY_SOCKET": str(work / "notify"),
            "GCE_METADATA_HOST": metadata_host,
            **(env or {}),
        }
        command = [sys.executable, "-m", "tpuboot", "--root", str(top), "--config", "/tpuboot.yaml", "run"]
        if nofile is not None:  # util-linux's prlimit execs the command: no preexec_fn, which can
            # deadlock the child of a process with threads before its exec (subprocess's docs)
            command = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *command]
        with contextlib.ExitStack() as files:
            sink = subprocess.PIPE if stderr is None else files.enter_context(stderr.open("w"))
            process = subprocess.Popen(command, cwd=REPO, env=environ, stderr=sink, text=True)
        running = RunningDaemon(process, notify)
        try:
            yield running
        finally:
            if running.process.poll() is None:
                running.process.kill()
            running.stderr = running.process.communicate(timeout=10)[1] or ""
            if stderr is not None:
                running.stderr = stderr.read_text()
            print(f"tpuboot run's stderr:\n{running.stderr}", file=sys.stderr)


@contextmanager
def started(argv: list[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """A long-running child (a server) for the block, killed at its end if still running: a failed
    assertion inside ends it, where ``with Popen(...)`` would wait for it for ever."""
    process = subprocess.Popen(argv, text=True, **popen)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def port_open(port: int) -> bool:
    """Whether something accepts on 127.0.0.1:``port`` now."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
