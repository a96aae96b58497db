"""What dockerd sends, read strictly and in bounded memory: the layer under
:mod:`tpuboot.containers.dockerapi`.

HTTP over dockerd's unix socket with a wall-clock deadline, its error answers as exceptions, the
JSON-lines streams (events, pull progress) as objects, and plain bodies checked against their
Content-Length. Whatever breaks the Engine API or HTTP is a one-line :class:`ProtocolError`, which
is an :class:`Unreachable`: the caller drops the connection and comes back later, as for a
dockerd that went away.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

from tpuboot.containers.engine import EngineError, EngineNotFound, EngineProtocolError, EngineUnreachable
from tpuboot.netio import DeadlineSocket
from tpuboot.numbers import ascii_int

#: Cap on one line of a stream (an event or a pull's progress is well under 4 KiB).
MAX_LINE = 1 << 20
#: Cap on the body of an error answer kept for its message.
MAX_ERROR_BODY = 64 << 10


class DockerError(EngineError):
    """Anything this client raises."""


class Unreachable(DockerError, EngineUnreachable):
    """dockerd is not there: no socket, connection refused, dropped or timed out."""


class ProtocolError(Unreachable, EngineProtocolError):
    """dockerd's answer broke the Engine API or HTTP: treated as dockerd not there (reconnect later)."""


class APIError(DockerError):
    """dockerd answered with an error; ``explanation`` is its message."""

    def __init__(self, status: int, explanation: str) -> None:
        super().__init__(f"{explanation} (HTTP {status})")
        self.status = status
        self.explanation = explanation


class NotFound(APIError, EngineNotFound):
    """404: no such container or image."""


class UnixConnection(http.client.HTTPConnection):
    """HTTP over an AF_UNIX stream socket; the host name is only the Host header."""

    def __init__(self, socket_path: str, timeout: float | None, deadline: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path
        #: The socket, also after http.client handed it to a response and forgot it.
        self.unix_sock: socket.socket | None = None
        #: When (monotonic) every receive and send of this connection ends; None: never.
        self.deadline = deadline

    def connect(self) -> None:
        sock = DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM, deadline=lambda: self.deadline)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = self.unix_sock = sock


def api_error(status: int, body: bytes) -> APIError:
    """dockerd's error answer ``{"message": ...}`` as an exception (a plain-text body as is)."""
    try:
        message = str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip() or http.client.responses.get(status, "error")
    return (NotFound if status == 404 else APIError)(status, message)


def _chunking_error(exc: BaseException) -> ProtocolError | None:
    """A broken chunked encoding as one line, None if ``exc`` is another failure.

    http.client raises ValueError or LineTooLong for a chunk size that is not hex, and wraps
    that ValueError in an IncompleteRead in some paths: the cause tells it from a dropped stream.
    """
    error: BaseException | None = exc
    for _ in range(4):  # the ValueError sits two or three exceptions down the chain
        if error is None:
            break
        if isinstance(error, ValueError) and str(error).endswith(": b''"):
            return None  # no size line at all: the connection ended (dockerd went away), not garbled
        if isinstance(error, (ValueError, http.client.LineTooLong)):
            return ProtocolError(
                f"dockerd sent a malformed chunked encoding ({why(error)[:80]}); is it dockerd?"
            )
        error = error.__cause__ or error.__context__
    return None


def json_objects(response: http.client.HTTPResponse, what: str = "a stream") -> Iterator[Any]:
    """Each JSON object of a streamed answer: dockerd writes one per line (pull progress, events).

    ``read1`` returns what has arrived (http.client undoes the chunked encoding), so an event is
    seen as soon as dockerd sends it. A line is at most :data:`MAX_LINE` bytes and must be JSON
    (:class:`ProtocolError`); OSError and HTTPException (dropped, cut short) pass through.
    """
    pending = bytearray()
    while True:
        try:
            chunk = response.read1(65536)
        except (ValueError, http.client.HTTPException) as exc:
            raise _chunking_error(exc) or exc from None
        if not chunk:
            break
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            if pending[start:end].strip():
                yield _json_line(bytes(pending[start:end]), what)
            start = end + 1
        del pending[:start]
        if len(pending) > MAX_LINE:
            raise ProtocolError(
                f"dockerd sent {what} with a line over {MAX_LINE} bytes and no newline; is it dockerd?"
            )
    if pending.strip():
        yield _json_line(bytes(pending), what)


def _json_line(line: bytes, what: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        raise ProtocolError(f"dockerd sent {what} with a line that is not JSON: {line[:60]!r}") from None


def read_body(response: http.client.HTTPResponse, cap: int, what: str) -> bytes:
    """The whole body in bounded memory, checked against its Content-Length (ASCII digits, <= ``cap``)."""
    declared: int | None = None
    if "chunked" not in (response.getheader("Transfer-Encoding") or "").lower():
        for value in response.headers.get_all("Content-Length") or []:
            length = ascii_int(value.strip(" \t"))
            if length is None:
                raise ProtocolError(f"dockerd sent Content-Length {value[:40]!r} for {what}, not a number")
            if declared is not None and length != declared:
                raise ProtocolError(f"dockerd sent two Content-Lengths for {what} ({declared}, {length})")
            declared = length
    if declared is not None and declared > cap:
        raise ProtocolError(f"dockerd announced {declared} bytes for {what}, over the {cap}-byte cap")
    if response.status in (204, 304):
        return b""
    body = bytearray()
    try:
        while declared is None or len(body) < declared:
            want = 65536 if declared is None else min(65536, declared - len(body))
            chunk = response.read(want)
            if not chunk:
                break
            body += chunk
            if len(body) > cap:
                raise ProtocolError(f"dockerd sent over {cap} bytes for {what}")
    except (ValueError, http.client.HTTPException) as exc:
        raise _chunking_error(exc) or exc from None
    if declared is not None and len(body) < declared:
        raise ProtocolError(f"dockerd's answer to {what} ended after {len(body)} of {declared} bytes")
    return bytes(body)


class EventStream:
    """An open ``GET /events`` answer: iterate for events; :meth:`close` from any thread ends it.

    The iteration ends, without an error, when the stream does: dockerd ended it, went away, or
    :meth:`close` cut it. Closing shuts the socket down, which makes a read blocked in another
    thread return at once; that thread then releases the connection (closing the answer under a
    read in progress would break the read, not end it).
    """

    def __init__(self, sock: socket.socket, response: http.client.HTTPResponse) -> None:
        self._sock = sock
        self._response = response
        self._lock = threading.Lock()
        self._reading = False
        self._closed = False
        self._released = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            if self._closed or self._reading:
                return
            self._reading = True
        try:
            for event in json_objects(self._response, "an event"):
                if isinstance(event, dict):
                    yield event
        except ProtocolError:
            if self._closed:
                return
            raise
        except (OSError, http.client.HTTPException):
            return
        finally:
            with self._lock:
                self._reading = False
            self._release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            reading = self._reading
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if not reading:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._response.close()
        self._sock.close()


def why(exc: BaseException) -> str:
    """An exception's message, or its type when it has none (``IncompleteRead(b'')``...)."""
    return str(exc) or type(exc).__name__
