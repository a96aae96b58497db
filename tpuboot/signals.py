"""What each signal means to `tpuboot run` (tpuboot(8), SIGNALS, says the same for people).

A signal left at its default would end the daemon without STOPPING=1 and without its stop (the
guest attributes' last write, the containers' handover), and systemd counts an end by SIGHUP,
SIGINT, SIGTERM or SIGPIPE as clean, so ``Restart=on-failure`` would not start it again. So every
signal systemd or a person may send has a meaning here:

- SIGTERM, SIGINT: stop (STOPPING=1, every part told to end, within :data:`STOP_BUDGET`).
  Once stopping, another one is logged and ignored: the stop is already bounded.
- SIGHUP: logged and ignored. tpuboot reads its configuration only at start; reloading it in place
  would mean re-binding devices and restarting containers under a half-old state, which a restart
  does cleanly (``systemctl restart tpuboot``).
- SIGUSR1: the daemon's state to the journal (STATUS, each part, threads, metrics connections).
- SIGUSR2: debug logging on, or back off.
- SIGQUIT: every thread's Python stack to the journal, one record per thread, taken on the loop
  under the GIL; the daemon runs on (as a JVM's thread dump does). Not ``faulthandler``: its dump
  of all threads from a signal handler reads other threads' frames unlocked, and a QUIT sent while
  they run crashed the daemon with SIGSEGV. A loop stuck for good is the watchdog's to end.
- SIGALRM, SIGVTALRM, SIGPROF, SIGIO, SIGPWR: not used by tpuboot; logged and ignored.
- SIGPIPE: ignored, as Python sets it at start: a write to a closed socket fails with EPIPE where it
  is made, and is handled there.
- SIGKILL and SIGSTOP cannot be caught; SIGTSTP, SIGTTIN, SIGTTOU keep their default (stop the
  process: under systemd the watchdog then restarts it).
- Every other signal keeps its default: SIGABRT (systemd's WatchdogSignal=), SIGSEGV, SIGBUS,
  SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGXCPU dump core, SIGSTKFLT and the real-time signals end the
  process; systemd counts each as a failure and restarts it. SIGXFSZ is ignored (as Python sets
  it); SIGCHLD, SIGCONT, SIGURG, SIGWINCH do nothing.

Each line a signal causes is rate-limited per signal (:class:`SignalLog`): a storm of them costs a
line every few seconds, with the count, not the journal. Before the loop takes over (the first
moments of start-up, while the TPUs are bound) the signals the loop would log are caught and
dropped (:func:`hold_until_served`); SIGTERM and SIGINT then still end the process at once, which
systemd counts as a clean stop of a start that had not finished.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from tpuboot.eventloop import nothing

log = logging.getLogger("tpuboot.signals")

#: The whole stop, after STOPPING=1, is bounded by this (seconds): under TimeoutStopSec=10 of the
#: unit, so tpuboot ends by itself before systemd would SIGKILL it.
STOP_BUDGET = 8.0
#: One line per signal per this many seconds at most; the repeats are counted in the next line.
LOG_INTERVAL = 5.0

STOP = (signal.SIGTERM, signal.SIGINT)
NO_RELOAD = (
    "tpuboot reads its configuration only at start; ignored "
    "(to apply a changed configuration: systemctl restart tpuboot)"
)
#: Signals that mean nothing to tpuboot, each with the reason given in its log line.
IGNORED: dict[signal.Signals, str] = {signal.SIGHUP: NO_RELOAD}
for _name in ("SIGALRM", "SIGVTALRM", "SIGPROF", "SIGIO", "SIGPWR"):
    _sig = getattr(signal, _name, None)
    if _sig is not None:
        IGNORED[_sig] = "not used by tpuboot; ignored"
#: What the loop logs or does for; a hold before it runs keeps these from ending the process.
HELD = (*IGNORED, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def hold_until_served() -> None:
    """Before the daemon's loop exists: catch (and drop) the signals it will log or act on.

    A caught signal, unlike an ignored one, is reset to its default in a child at exec, so an
    exec-runtime child started later does not inherit it ignored.
    """
    for sig in HELD:
        signal.signal(sig, nothing)  # held before the loop runs: nothing to do yet


def thread_stacks() -> list[tuple[str, str]]:
    """(thread name, its Python stack) for every thread now, the caller's own included."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return [
        (names.get(ident, f"thread {ident}"), "".join(traceback.format_stack(frame)).rstrip())
        for ident, frame in sys._current_frames().items()
    ]


class SignalLog:
    """Logs the lines signals cause, at most one per signal per :data:`LOG_INTERVAL`, with repeats."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: dict[int, float] = {}
        self._repeats: dict[int, int] = {}

    def due(self, sig: int) -> str | None:
        """Whether a line for ``sig`` may go now: None if not (counted), else the repeats to mention."""
        now = self.clock()
        last = self._last.get(sig)
        if last is not None and now - last < LOG_INTERVAL:
            self._repeats[sig] = self._repeats.get(sig, 0) + 1
            return None
        self._last[sig] = now
        repeats = self._repeats.pop(sig, 0)
        return f" ({repeats} more since the last line)" if repeats else ""

    def log(self, sig: int, level: int, message: str, *args: object) -> None:
        more = self.due(sig)
        if more is not None:
            name = signal.Signals(sig).name
            log.log(level, f"%s: {message}%s", name, *args, more, extra={"SIGNAL": name})
