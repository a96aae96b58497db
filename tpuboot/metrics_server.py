"""The metrics endpoint's HTTP server: whatever a client does, it holds a bounded share of the daemon.

Any local process can connect to the port, so each resource a connection takes is bounded:

- **connections, fds and threads**: at most ``max_connections`` at once (:data:`MAX_CONNECTIONS`,
  or a quarter of the soft fd limit if that is less), one thread each. At the cap the server stops
  accepting: further connections wait in the kernel's listen backlog (bounded by the kernel, not
  held by tpuboot), and the daemon's own fds (tpu-env writes, sd_notify, the journal, udev,
  docker, the metadata server) stay free. The unit's ``LimitNOFILE=`` says why its limit is what it is.
- **time**: each connection's whole exchange (request line, headers, answer) ends by one
  wall-clock deadline (:data:`REQUEST_DEADLINE`, Prometheus' own default scrape timeout), however
  slowly the client sends or reads (:class:`tpuboot.netio.DeadlineSocket`).
- **memory**: a request is read up to :data:`MAX_REQUEST_BYTES` (a scrape's is a few hundred);
  beyond that the server answers 431 or drops it, never buffering the 64 KiB lines times 100
  headers the standard library would.
- **accept errors**: EMFILE, ENFILE, ENOBUFS, ENOMEM back off (:class:`tpuboot.backoff.Backoff`:
  doubling, up to :data:`ACCEPT_BACKOFF_MAX`) and are logged once per streak, instead of spinning a core.

Stopping wakes the accept loop through a pipe of its own (never a connection to its own address,
which an ``IPAddressAllow=`` without loopback would refuse), cuts the connections open, and waits
for the loop :data:`SHUTDOWN_WAIT` at most.

Built from the standard library around prometheus_client's public ``make_wsgi_app``: the server
and handler classes prometheus_client keeps in its exposition module are private and differ across
the versions tpuboot supports (0.9 on Ubuntu 22.04 to 0.21 on Debian 13).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from tpuboot.backoff import Backoff
from tpuboot.netio import DeadlineSocket

log = logging.getLogger("tpuboot.metrics")

#: Scrape connections served at once, at most (a Prometheus server or two, a curl, `tpuboot doctor`).
MAX_CONNECTIONS = 16
#: A connection's whole exchange ends by this many seconds after it was accepted.
REQUEST_DEADLINE = 10.0
#: The most of a request that is read: the request line and every header together.
MAX_REQUEST_BYTES = 16 * 1024
#: accept() failing for want of fds or memory: first wait, doubled up to the maximum (seconds).
ACCEPT_BACKOFF_FIRST = 0.05
ACCEPT_BACKOFF_MAX = 2.0
_ACCEPT_BACKOFF = Backoff(ACCEPT_BACKOFF_FIRST, ACCEPT_BACKOFF_MAX, floor=0.0)
#: How long shutdown() waits for the accept loop to end.
SHUTDOWN_WAIT = 2.0
_SCARCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def connection_cap(limit: int = MAX_CONNECTIONS) -> int:
    """``limit``, or a quarter of the soft fd limit if that is less: the rest stays the daemon's."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limit
    return max(1, min(limit, soft // 4))


class RequestTooLarge(http.client.HTTPException):
    """More than MAX_REQUEST_BYTES of request line and headers: not a scrape."""


class _Capped:
    """The request's reader, cut off at ``limit`` bytes: readline and read never buffer beyond it."""

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self._left = limit

    def _allow(self, size: int | None) -> int:
        if self._left <= 0:
            raise RequestTooLarge(f"request over {MAX_REQUEST_BYTES} bytes")
        return self._left if size is None or size < 0 else min(size, self._left)

    def readline(self, size: int | None = -1) -> bytes:
        line: bytes = self._inner.readline(self._allow(size))
        self._left -= len(line)
        if self._left <= 0 and not line.endswith(b"\n"):  # cut by the cap, not by the caller's size
            raise RequestTooLarge(f"request over {MAX_REQUEST_BYTES} bytes")
        return line

    def read(self, size: int | None = -1) -> bytes:
        data: bytes = self._inner.read(self._allow(size))
        self._left -= len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Discard:
    """wsgiref's stderr for a request: a client that hangs up mid-answer is not a traceback in the journal."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class QuietHandler(WSGIRequestHandler):
    """One request per connection (HTTP/1.0), read within MAX_REQUEST_BYTES, logging nothing per
    scrape: a scrape every 15 s is not news."""

    def setup(self) -> None:
        super().setup()
        self.rfile = _Capped(self.rfile, MAX_REQUEST_BYTES)  # type: ignore[assignment]

    def get_stderr(self) -> Any:
        return _Discard()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer(WSGIServer):
    """The endpoint; :meth:`start` serves it in a daemon thread, :meth:`shutdown` ends it."""

    request_queue_size = MAX_CONNECTIONS  # the kernel's backlog: what waits beyond the cap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.max_connections = connection_cap()
        self.deadline = REQUEST_DEADLINE
        self._cond = threading.Condition()
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scarce: str | None = None  # why accept() fails, while it does (logged once)
        self._wake_r, self._wake_w = os.pipe()
        self._pipe_open = True
        super().__init__(*args, **kwargs)  # binds and listens; on failure calls server_close

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._cond:
            return len(self._open)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="tpuboot-metrics", daemon=True)
        self._thread.start()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept until :meth:`shutdown`, one thread per connection, never more than the cap.
        ``poll_interval`` is not used: nothing polls, the loop sleeps until a client or shutdown."""
        self.socket.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            failures = 0  # accepts in a row that found no fd or memory to spare
            while self._wait_for_a_slot():
                if not any(key.fd == self.socket.fileno() for key, _ in selector.select()):
                    continue  # woken to stop
                if self._accept_one():
                    failures = 0
                elif self._scarce is not None:
                    self._stop.wait(_ACCEPT_BACKOFF.ceiling(failures))  # wait, never spin
                    failures += 1

    def _wait_for_a_slot(self) -> bool:
        """Until a connection may be taken (each open one ends by its deadline); False at shutdown."""
        with self._cond:
            while len(self._open) >= self.max_connections and not self._stop.is_set():
                self._cond.wait()
            return not self._stop.is_set()

    def _accept_one(self) -> bool:
        """One connection accepted and handed to a thread of its own; False if there was none."""
        try:
            conn, address = self.socket.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno in _SCARCE:
                self._short_of(f"accept: {os.strerror(exc.errno or 0)}")
            return False
        sock = DeadlineSocket.adopt(conn, _deadline_in(self.deadline))
        sock.settimeout(self.deadline)
        with self._cond:
            self._open.add(sock)
        try:
            threading.Thread(
                target=self._serve_one, args=(sock, address), name="tpuboot-metrics-scrape", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had: as short of resources as EMFILE
            self._end(sock)
            self._short_of(f"thread: {exc}")
            return False
        if self._scarce is not None:
            log.info("metrics: accepting scrapes again (was: %s)", self._scarce)
            self._scarce = None
        return True

    def _short_of(self, why: str) -> None:
        if self._scarce is None:
            log.warning("metrics: cannot take a scrape connection (%s); backing off, the daemon goes on", why)
        self._scarce = why

    def _serve_one(self, sock: socket.socket, address: Any) -> None:
        try:
            self.finish_request(sock, address)
        except Exception as exc:  # a client's timeout, reset, or oversized request: its own end only
            log.debug("metrics: connection from %s ended: %s", address, exc)
        finally:
            self._end(sock)

    def _end(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        sock.close()
        with self._cond:
            self._open.discard(sock)
            self._cond.notify()

    def shutdown(self) -> None:
        """End the accept loop (woken through its pipe) and cut every open connection; waits
        SHUTDOWN_WAIT at most."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread is not None:
            self._thread.join(SHUTDOWN_WAIT)
            if self._thread.is_alive():
                log.warning("metrics: the endpoint did not end within %g s; leaving it", SHUTDOWN_WAIT)

    def server_close(self) -> None:
        super().server_close()
        if self._pipe_open and (self._thread is None or not self._thread.is_alive()):
            self._pipe_open = False  # (else its selector still holds them: left to the exit)
            os.close(self._wake_r)
            os.close(self._wake_w)


def _deadline_in(seconds: float) -> Callable[[], float]:
    """A DeadlineSocket's deadline: ``seconds`` from now, fixed."""
    end = time.monotonic() + seconds
    return lambda: end
