"""The daemon's event loop: one thread, one selector, a heap of timers, a queue from other threads.

The daemon needs four things of a loop: a reader (the udev monitor), timers (retries, the READY
deadline, the watchdog), wakeups from other threads (the worker pool's results, the parts'
reports) and SIGTERM. asyncio does all four at the cost of about 30 modules loaded (and kept
resident) on the way to READY; this is those four on ``selectors``, nothing else.

Rules: every method but :meth:`call_soon_threadsafe` and :meth:`stop` is for the loop's own
thread. The selector sleeps until the next timer or an event: there is no polling. A callback
that raises is logged with its traceback and the loop goes on, so a bug in one device's handling
never ends the daemon.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import selectors
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

log = logging.getLogger("tpuboot.eventloop")

#: A timer due within this much of now runs now: the selector rounds its timeout up to a
#: millisecond, so waiting for the rest would be one more wakeup for nothing.
SLACK = 0.001
#: What a thread writes to the wake-up pipe; a signal's handler writes its number (never 0).
_WAKE = b"\0"


@dataclass(eq=False)
class Timer:
    """A call at a monotonic time; :meth:`cancel` before it runs and it never does."""

    when: float
    fn: Callable[..., object]
    args: tuple[object, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        self.fn, self.args = nothing, ()  # what it would have held stays out of the heap


class EventLoop:
    """Readers, timers, calls from other threads and signals, run on the thread of :meth:`run_until`;
    ``selector`` is a seam for the tests (one that counts its wake-ups)."""

    def __init__(self, selector: selectors.BaseSelector | None = None) -> None:
        self._selector = selector or selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Timer]] = []
        self._sequence = 0  # ties between timers due at once go in the order they were set
        self._ready: deque[tuple[Callable[..., object], tuple[object, ...]]] = deque()
        self._lock = threading.Lock()  # a thread's write to the pipe against close()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already holds a wake-up
        self._woken = False
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain)
        self._signals: dict[int, Callable[[], object]] = {}
        self._previous: dict[int, object] = {}
        self._previous_wakeup_fd: int | None = None
        self._stopping = False
        self._closed = False

    # ------------------------------------------------------------------ what the loop thread calls

    def add_reader(self, fd: int, callback: Callable[[], object]) -> None:
        """``callback()`` on the loop each time ``fd`` is readable."""
        try:
            self._selector.register(fd, selectors.EVENT_READ, callback)
        except KeyError:
            self._selector.modify(fd, selectors.EVENT_READ, callback)

    def remove_reader(self, fd: int) -> bool:
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            return False
        return True

    def call_later(self, delay: float, fn: Callable[..., object], *args: object) -> Timer:
        """``fn(*args)`` on the loop after ``delay`` seconds (of the monotonic clock)."""
        timer = Timer(time.monotonic() + delay, fn, args)
        self._sequence += 1
        heapq.heappush(self._timers, (timer.when, self._sequence, timer))
        return timer

    def add_signal_handler(self, sig: int, fn: Callable[[], object]) -> None:
        """``fn()`` on the loop after ``sig`` arrives; only from the main thread (Python's rule).

        The signal's number reaches the loop through the wake-up pipe (``signal.set_wakeup_fd``),
        written by the C-level handler, so a signal that arrives just before the selector sleeps
        still wakes it. :meth:`close` puts back what was there before.
        """
        if not self._signals:
            # A full pipe already holds wake-ups enough: no "Exception ignored" line per signal of a storm.
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._previous.setdefault(sig, signal.signal(sig, _on_signal))
        self._signals[sig] = fn

    def run_until(self, done: Callable[[], bool] | None = None) -> None:
        """Run until ``done()`` is true (checked after every round of callbacks) or :meth:`stop`."""
        while not self._stopping and not (done is not None and done()):
            self._once()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def close(self) -> None:
        """Release the selector and the pipe, and give the signals back; later wake-ups are dropped."""
        if self._closed:
            return
        if self._signals:
            for sig, previous in self._previous.items():  # None: a handler not set from Python
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # type: ignore[arg-type]
            signal.set_wakeup_fd(-1 if self._previous_wakeup_fd is None else self._previous_wakeup_fd)
            self._signals.clear()
            self._previous.clear()
        with self._lock:
            self._closed = True
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ------------------------------------------------------------------ what any thread calls

    def call_soon_threadsafe(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` on the loop, soon; from any thread. Dropped once the loop is closed: the
        daemon is then past its stop, with nothing left to show."""
        self._ready.append((fn, args))  # deque.append is atomic
        self._wake()

    def stop(self) -> None:
        """End :meth:`run_until` (and every later one) after the current round; from any thread."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        if self._woken:
            return  # a wake-up is already in the pipe: the loop reads the queue after it
        with self._lock:
            if self._closed:
                return
            self._woken = True
            with contextlib.suppress(BlockingIOError):  # full: the loop has wake-ups enough to read
                os.write(self._wake_w, _WAKE)

    # ------------------------------------------------------------------ one round

    def _once(self) -> None:
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)  # a cancelled timer is no reason to wake
        if self._ready:
            timeout: float | None = 0.0
        elif timers:
            timeout = max(0.0, timers[0][0] - time.monotonic())
        else:
            timeout = None
        for key, _ in self._selector.select(timeout):
            self._call(key.data)
        due = time.monotonic() + SLACK
        while timers and timers[0][0] <= due:
            timer = heapq.heappop(timers)[2]
            if not timer.cancelled:
                self._call(timer.fn, *timer.args)
        for _ in range(len(self._ready)):  # what these callbacks queue waits for the next round
            fn, args = self._ready.popleft()
            self._call(fn, *args)

    def _drain(self) -> None:
        """The wake-up pipe: a thread's wake-up (its call is in the queue) or a signal's number.

        ``_woken`` is cleared only once the pipe is empty: cleared before the reads, a thread could
        write its wake-up during them and see it read at once, leaving ``_woken`` set over an empty
        pipe, and every later call, and :meth:`stop`, would then wake nothing. While it is set,
        a thread writes nothing: its call is already queued, and this round runs the queue after
        this drain."""
        try:
            while data := os.read(self._wake_r, 4096):
                for byte in data:
                    handler = self._signals.get(byte)
                    if handler is not None:
                        self._ready.append((handler, ()))
        except BlockingIOError:
            pass
        finally:
            self._woken = False

    @staticmethod
    def _call(fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("unexpected error in %s; the daemon goes on, please report it", _name(fn))


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing; the signal's number already woke the loop (the pipe)."""


def nothing(*args: object) -> None:
    """Does nothing: the ``report`` of a part nobody listens to, a callback that only wakes
    the loop, the callable a cancelled timer holds."""


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
