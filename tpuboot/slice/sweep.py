"""Connect to every (address, port) of the slice at once, each bounded, the whole bounded.

One thread, non-blocking sockets and a selector: at most ``window`` connects are in flight, each
ends by its own timeout, and the sweep ends by ``deadline`` whatever the peers do, so 64 peers of
3 ports with one peer dropped take about one connect timeout, not 192. Nothing is sent or read:
a connect is the whole question, so a peer that accepts and never answers cannot hold the sweep.

What the kernel says of a connect is the verdict:

- ``open``: the handshake completed (something listens);
- ``refused``: RST (nothing listens yet, but the path is open: not a failure before a job);
- ``dropped``: no answer before the timeout (a firewall drops it);
- ``unreachable``: EHOSTUNREACH or ENETUNREACH (no route, or the host is down);
- ``error``: any other errno, named.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OPEN, REFUSED, DROPPED, UNREACHABLE, ERROR = "open", "refused", "dropped", "unreachable", "error"
#: Every state a path can end in (the metrics count each, 0 included).
STATES = (OPEN, REFUSED, DROPPED, UNREACHABLE, ERROR)
#: States in which the path is open: a job can reach the port once its listener is up.
PASSABLE = (OPEN, REFUSED)
#: At most this many connects in flight (each holds an fd until it ends).
WINDOW = 256
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


@dataclass(frozen=True)
class Target:
    """One path to check: an address (IPv4 text), a port, and whose it is."""

    worker: int
    address: str
    port: int
    purpose: str


@dataclass(frozen=True)
class Outcome:
    target: Target
    state: str
    detail: str = ""


def _verdict(code: int) -> tuple[str, str]:
    if code == 0:
        return OPEN, ""
    if code == errno.ECONNREFUSED:
        return REFUSED, ""
    if code in _UNREACHABLE:
        return UNREACHABLE, os.strerror(code)
    if code == errno.ETIMEDOUT:
        return DROPPED, ""
    return ERROR, os.strerror(code)


def _start(target: Target) -> tuple[socket.socket | None, Outcome | None]:
    """A non-blocking connect begun, or its outcome when the kernel answered at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        code = sock.connect_ex((target.address, target.port))
    except OSError as exc:  # an address the kernel refuses outright
        sock.close()
        return None, Outcome(target, ERROR, exc.strerror or str(exc))
    if code in (errno.EINPROGRESS, errno.EALREADY):
        return sock, None
    sock.close()
    return None, Outcome(target, *_verdict(code))


class _InFlight:
    """The connects begun and not yet answered, each with its due time."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.due: dict[socket.socket, tuple[int, Target, float]] = {}

    def add(self, sock: socket.socket, i: int, target: Target, due: float) -> None:
        self.selector.register(sock, selectors.EVENT_WRITE)
        self.due[sock] = (i, target, due)

    def end(self, sock: socket.socket) -> tuple[int, Target]:
        i, target, _ = self.due.pop(sock)
        self.selector.unregister(sock)
        sock.close()
        return i, target

    def answered(self, now: float) -> list[socket.socket]:
        """The sockets whose connect has an answer, waiting at most until the soonest is due."""
        soonest = min(due for _, _, due in self.due.values())
        ready = self.selector.select(max(0.0, soonest - now))
        return [key.fileobj for key, _ in ready if isinstance(key.fileobj, socket.socket)]

    def overdue(self, now: float) -> list[socket.socket]:
        return [sock for sock, (_, _, due) in self.due.items() if due <= now]

    def close(self) -> None:
        for sock in list(self.due):
            self.end(sock)
        self.selector.close()


def sweep(
    targets: Sequence[Target],
    *,
    connect_timeout: float,
    deadline_s: float,
    window: int = WINDOW,
    clock: Callable[[], float] = time.monotonic,
) -> list[Outcome]:
    """Each target's outcome, in the order given; ends by ``deadline_s`` (what is left is dropped)."""
    end = clock() + deadline_s
    pending = list(enumerate(targets))[::-1]
    results: dict[int, Outcome] = {}
    flight = _InFlight()
    try:
        while pending or flight.due:
            now = clock()
            while pending and len(flight.due) < window and now < end:
                i, target = pending.pop()
                sock, outcome = _start(target)
                if sock is not None:
                    flight.add(sock, i, target, min(now + connect_timeout, end))
                elif outcome is not None:
                    results[i] = outcome
            if not flight.due:
                break
            for sock in flight.answered(clock()):
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                i, target = flight.end(sock)
                results[i] = Outcome(target, *_verdict(code))
            for sock in flight.overdue(clock()):
                i, target = flight.end(sock)
                results[i] = Outcome(target, DROPPED)
    finally:
        flight.close()
    for i, target in pending:  # not begun before the deadline
        results[i] = Outcome(target, DROPPED, "not tried before the deadline")
    return [results[i] for i in range(len(targets))]
