"""vBar for containers without host networking: a unix socket relayed to vBar's endpoint.

libtpu (v6e on) reaches vBar at ``VBAR_CONTROL_SERVICE_URL``; the supervised vBar listens on the
host's network (``vbar.endpoint``, 127.0.0.1:8353), which a container in its own network namespace
cannot reach. GKE's TPU device plugin gives a container vBar's unix socket in a mounted directory
(``unix:///var/run/tpu-plugin/vbar.sock``); tpuboot does the same with a socket it owns,
``/run/tpuboot/vbar/vbar.sock``, mounted by the CDI spec (tpuboot/containers/cdi.py), and copies
each connection's bytes to and from the endpoint: no IP traffic from the container, no address
that depends on the engine's bridge, nothing of vBar's protocol interpreted.

Permissions: the directory is 0755 and the socket 0666. The socket gives exactly what any local
process has already (a connect to 127.0.0.1:8353), and a container's job runs as any uid, which a
group would not reach across user namespaces.

Bounds: one thread of its own (a selector loop: the daemon's event loop never waits on it), at
most ``max_connections`` relayed at once (one more is closed at accept), each direction copied
through one fixed buffer (a side that does not read stops the other side's reads: memory never
grows with what a client sends or refuses to read), a connection closed after ``idle_timeout``
seconds without a byte either way. vBar down: the client's connection is closed as soon as the
connect fails.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpuboot.component import Part, Report
from tpuboot.containers.cdi import RELAY_DIR, RELAY_SOCKET
from tpuboot.containers.cdi_file import make_relay_dir
from tpuboot.eventloop import nothing

if TYPE_CHECKING:
    from tpuboot.endpoints import Endpoint
    from tpuboot.paths import Root

log = logging.getLogger("tpuboot.containers.vbar_relay")

MAX_CONNECTIONS = 64
IDLE_TIMEOUT = 600.0  # a libtpu keeps its channel open while it runs; a dead peer lets go
BUFFER = 65536
STOP_WAIT = 5.0


class _Direction:
    """Bytes from ``src`` to ``dst`` through one fixed buffer: read only when it is empty."""

    def __init__(self, src: socket.socket, dst: socket.socket, size: int) -> None:
        self.src, self.dst = src, dst
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0  # the bytes read and not yet written: buffer[start:end]
        self.eof = False  # src said it sends no more
        self.done = False  # ... and dst was told (shutdown SHUT_WR)

    @property
    def pending(self) -> int:
        return self.end - self.start


class _Pair:
    """One relayed connection: the client's socket and vBar's, and the two directions."""

    def __init__(self, client: socket.socket, upstream: socket.socket, size: int) -> None:
        self.client, self.upstream = client, upstream
        self.connected = False  # the connect to vBar finished
        self.up = _Direction(client, upstream, size)
        self.down = _Direction(upstream, client, size)
        self.last = time.monotonic()

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            sock.close()


class VbarRelay(Part):
    """Serves ``/run/tpuboot/vbar/vbar.sock`` (under ``root``) and relays to ``target``: a part of
    the daemon with no line in STATUS, stopped after the containers it serves."""

    name = "vBar relay"
    stops_after_metadata = True

    def __init__(
        self,
        root: Root,
        target: Endpoint,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
        buffer: int = BUFFER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.target = target
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.buffer = buffer
        self.clock = clock
        self.path = str(root.path(RELAY_SOCKET))
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._pairs: dict[socket.socket, _Pair] = {}  # both sockets of each pair; the thread's own
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused = 0  # connections closed at accept (over the cap), said in the journal

    # ------------------------------------------------------------------ from the daemon

    def start(self, report: Report = nothing) -> None:
        """Bind the socket and serve it in a thread of its own; a failure is one journal line (the
        daemon and the containers that need no vBar run on without it)."""
        try:
            self._listener = self._listen()
        except OSError as exc:
            log.error(
                "vBar relay: cannot serve %s (%s); containers without host networking cannot reach vBar",
                RELAY_SOCKET, exc.strerror or exc, extra={"VBAR_RELAY": RELAY_SOCKET})  # fmt: skip
            return
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="tpuboot-vbar-relay", daemon=True)
        self._thread.start()
        log.info("vBar relay: %s to %s", RELAY_SOCKET, self.target, extra={"VBAR_RELAY": RELAY_SOCKET})

    def stop(self) -> None:
        """Every connection closed, the socket removed; returns within STOP_WAIT."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(STOP_WAIT)
        else:
            self._close_all()

    @property
    def connections(self) -> int:
        """How many connections are relayed now (read from any thread: a snapshot)."""
        return len(self._pairs) // 2

    def buffered(self) -> int:
        """The bytes held between the sides now (bounded by 2 x buffer per connection)."""
        pairs = {id(p): p for p in list(self._pairs.values())}.values()
        return sum(p.up.pending + p.down.pending for p in pairs)

    # ------------------------------------------------------------------ setup

    def _listen(self) -> socket.socket:
        make_relay_dir(self.root)  # the CDI spec's writer made it already, if it mounts it
        directory = self.root.path(RELAY_DIR)
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a past run's
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            listener.bind(short_path(fd, self.path))
            os.chmod(self.path, 0o666)
            listener.listen(16)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        finally:
            os.close(fd)
        return listener

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, events in self._selector.select(self._timeout()):
                    if self._stopping.is_set():
                        break
                    self._on_event(key.fileobj, events)  # type: ignore[arg-type]
                self._close_idle()
        except Exception:  # a bug: the relay ends, the daemon runs on
            log.exception("vBar relay: stopped by an unexpected error; please report it")
        finally:
            self._close_all()

    def _timeout(self) -> float | None:
        if not self._pairs:
            return None
        oldest = min(p.last for p in self._pairs.values())
        return max(0.0, oldest + self.idle_timeout - self.clock())

    def _on_event(self, sock: socket.socket, events: int) -> None:
        if sock is self._listener:
            self._accept()
        elif sock is self._wake_r:
            return
        else:
            pair = self._pairs.get(sock)
            if pair is not None:
                self._step(pair, sock, events)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if self.connections >= self.max_connections:
            client.close()
            self._refused += 1
            if self._refused in (1, 10, 100) or self._refused % 1000 == 0:
                log.warning(
                    "vBar relay: %d connections closed at once: %d are relayed already (the most)",
                    self._refused, self.max_connections, extra={"VBAR_RELAY": RELAY_SOCKET})  # fmt: skip
            return
        client.setblocking(False)
        target = self.target
        upstream = socket.socket(socket.AF_UNIX if target.path else _family(target.host), socket.SOCK_STREAM)
        upstream.setblocking(False)
        pair = _Pair(client, upstream, self.buffer)
        pair.last = self.clock()
        address: str | tuple[str, int] = (target.host, target.port)
        if target.path:
            address = str(self.root.path(target.path))
        err = upstream.connect_ex(address)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            log.debug("vBar relay: connect to %s: %s", target, os.strerror(err))
            pair.close()  # vBar down: the client sees its connection end at once
            return
        self._pairs[client] = self._pairs[upstream] = pair
        pair.connected = err == 0
        self._register(pair)

    def _step(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        if not pair.connected:
            if sock is pair.upstream and events & selectors.EVENT_WRITE:
                err = pair.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    log.debug("vBar relay: connect to %s: %s", self.target, os.strerror(err))
                    self._drop(pair)
                    return
                pair.connected = True
                self._register(pair)
            return
        try:
            for direction in (pair.up, pair.down):
                if events & selectors.EVENT_READ and sock is direction.src:
                    self._read(direction)
                if events & selectors.EVENT_WRITE and sock is direction.dst:
                    self._write(direction)
        except OSError:  # a reset or broken pipe on either side ends the pair
            self._drop(pair)
            return
        pair.last = self.clock()
        if pair.up.done and pair.down.done:
            self._drop(pair)
        else:
            self._register(pair)

    def _read(self, direction: _Direction) -> None:
        if direction.pending or direction.eof:
            return
        try:
            n = direction.src.recv_into(direction.view)
        except (BlockingIOError, InterruptedError):
            return
        if n == 0:
            direction.eof = True
        direction.start, direction.end = 0, n
        self._flush(direction)

    def _write(self, direction: _Direction) -> None:
        self._flush(direction)

    def _flush(self, direction: _Direction) -> None:
        if direction.pending:
            try:
                sent = direction.dst.send(direction.view[direction.start : direction.end])
            except (BlockingIOError, InterruptedError):
                return
            direction.start += sent
        if not direction.pending and direction.eof and not direction.done:
            direction.done = True
            direction.dst.shutdown(socket.SHUT_WR)  # the half-close reaches the other side

    def _register(self, pair: _Pair) -> None:
        """Each socket waits for what can move a byte now: a read into an empty buffer, a write of
        a held one; the connect to vBar for writability."""
        wants: dict[socket.socket, int] = {pair.client: 0, pair.upstream: 0}
        if not pair.connected:
            wants[pair.upstream] = selectors.EVENT_WRITE
        else:
            for direction in (pair.up, pair.down):
                if direction.pending:
                    wants[direction.dst] |= selectors.EVENT_WRITE
                elif not direction.eof:
                    wants[direction.src] |= selectors.EVENT_READ
        for sock, events in wants.items():
            registered = self._registered(sock)
            if events and registered:
                self._selector.modify(sock, events)
            elif events:
                self._selector.register(sock, events)
            elif registered:
                self._selector.unregister(sock)

    def _registered(self, sock: socket.socket) -> bool:
        try:
            self._selector.get_key(sock)
        except KeyError:
            return False
        return True

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.upstream):
            if self._registered(sock):
                self._selector.unregister(sock)
            self._pairs.pop(sock, None)
        pair.close()

    def _close_idle(self) -> None:
        now = self.clock()
        idle = {id(p): p for p in self._pairs.values() if now - p.last >= self.idle_timeout}
        for pair in idle.values():
            log.debug("vBar relay: a connection idle for %g s closed", self.idle_timeout)
            self._drop(pair)

    def _close_all(self) -> None:
        for pair in {id(p): p for p in list(self._pairs.values())}.values():
            self._drop(pair)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def short_path(directory_fd: int, path: str) -> str:
    """``path`` through its directory's descriptor: a socket address holds 107 bytes, which a root
    deep in a test's temporary tree passes."""
    return f"/proc/self/fd/{directory_fd}/{os.path.basename(path)}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
