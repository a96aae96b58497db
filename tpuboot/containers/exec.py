"""The exec runtime: vBar as a child process of tpuboot (``vbar.runtime: exec``).

Its output goes where tpuboot's goes (the journal). At stop it gets SIGTERM, then SIGKILL
after ``term_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Sequence

from tpuboot.containers.supervisor import RuntimeUnavailable, Started, StartFailed


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class ExecRuntime:
    def __init__(self, argv: Sequence[str], term_timeout: float = 5.0) -> None:
        self.argv = tuple(argv)
        self.term_timeout = term_timeout
        self.fields = {"AGENT_ARGV0": self.argv[0]}
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> Started:
        with self._lock:
            if self._closed:
                raise RuntimeUnavailable("stopping")
            try:
                # Its own session: a signal for tpuboot's process group is not also the child's.
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise StartFailed(f"cannot run {self.argv[0]}: {exc.strerror}") from None
            return Started("started", f"pid {self.proc.pid}")

    def wait(self) -> str | None:
        proc = self.proc
        if proc is None:
            return None
        return describe_exit(proc.wait())

    def interrupt(self) -> bool:
        """The argv does not change at run time: nothing to reconsider."""
        return False

    def kill(self) -> None:
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.term_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
