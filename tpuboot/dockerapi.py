"""A small Docker Engine API client over dockerd's unix socket, on the standard library alone.

Only the calls tpuboot's container supervision needs (:mod:`tpuboot.containers` holds the
policy): inspect, create, start and remove a container, inspect and pull an image, follow the
event stream. The docker SDK did the same at a cost of ~14 MiB of resident memory and a second
of start-up on a slow CPU, for a dozen HTTP requests.

- The API version is negotiated: ``GET /version`` (unversioned) once, then, as Docker's own
  client does, dockerd's newest version capped at tpuboot's (:data:`NEWEST_API`); and never
  below dockerd's ``MinAPIVersion`` (a clear error instead of a refused call). A fixed old
  version would be refused by newer engines, which raise their minimum (Docker 29, Ubuntu's
  docker.io in jammy and noble updates: 1.44); an uncapped one would speak a version whose
  changes nobody read against tpuboot's calls. A call refused as too old or too new (dockerd
  upgraded under a running tpuboot) renegotiates and is sent once more.
- Each call opens its own connection: nothing idle goes stale across a dockerd restart, and a
  transport error always means dockerd is not there (:class:`Unreachable`), never a half-used
  connection. The events stream has no timeout; every other call has one.
- An HTTP error answer is an :class:`APIError` with dockerd's own ``message``; 404 is
  :class:`NotFound`. A pull that fails answers 200 and reports the failure inside the stream:
  that is an :class:`APIError` too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

DOCKER_SOCKET = "/run/docker.sock"
#: The newest Engine API version tpuboot speaks: Docker 29.0's. moby's API changelog from 1.41
#: (Debian 12's docker.io, the oldest engine tested) to 1.56 was read against what tpuboot sends
#: (create: Image, Labels, HostConfig Privileged, NetworkMode, Binds; start; remove with force;
#: pull by fromImage and tag; events filtered by type, container and event, no Accept header)
#: and reads (Id, State, Config Image and Labels, HostConfig, an event's Action and Actor, a
#: pull's errorDetail). What moved: 1.44 makes ``:ro`` binds recursively read-only (tpuboot
#: binds one file: no difference), 1.52 drops the events' old status/id/from (read only as a
#: fallback) and 1.53 lets /events answer JSON Lines when asked (tpuboot does not ask). Raise
#: the cap only with a test against that version.
NEWEST_API = "1.52"
#: The oldest: what Docker's own client assumes of a daemon that does not say (Docker 1.12); the
#: calls tpuboot makes are older, but nothing below 1.41 is tested.
OLDEST_API = "1.24"
_VERSION = re.compile(r"\d+\.\d+")
#: dockerd's refusal of a version outside its range (API middleware), HTTP 400.
_REFUSED = re.compile(r"client version \S+ is too (old|new)")
TIMEOUT = 60.0
#: Cap on a plain (not streamed) answer: inspect data is a few KiB.
MAX_BODY = 16 << 20


class DockerError(Exception):
    """Anything this client raises."""


class Unreachable(DockerError):
    """dockerd is not there: no socket, connection refused, dropped or timed out."""


class APIError(DockerError):
    """dockerd answered with an error; ``explanation`` is its message."""

    def __init__(self, status: int, explanation: str) -> None:
        super().__init__(f"{explanation} (HTTP {status})")
        self.status = status
        self.explanation = explanation


class NotFound(APIError):
    """404: no such container or image."""


def _key(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


def negotiate(newest: str, oldest: str | None) -> str:
    """The version to speak with a dockerd whose range is ``oldest``..``newest``."""
    chosen = min(newest, NEWEST_API, key=_key)
    if oldest is not None and _key(chosen) < _key(oldest):
        raise DockerError(
            f"dockerd accepts Engine API {oldest} to {newest} and tpuboot speaks {OLDEST_API} to "
            f"{NEWEST_API}: upgrade tpuboot"
        )
    if _key(chosen) < _key(OLDEST_API):
        raise DockerError(
            f"dockerd speaks Engine API {newest} at most and tpuboot needs {OLDEST_API}: upgrade Docker"
        )
    return chosen


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over an AF_UNIX stream socket; the host name is only the Host header."""

    def __init__(self, socket_path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path
        #: The socket, also after http.client handed it to a response and forgot it.
        self.unix_sock: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = self.unix_sock = sock


def _api_error(status: int, body: bytes) -> APIError:
    """dockerd's error answer ``{"message": ...}`` as an exception (a plain-text body as is)."""
    try:
        message = str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip() or http.client.responses.get(status, "error")
    return (NotFound if status == 404 else APIError)(status, message)


def _json_objects(response: http.client.HTTPResponse) -> Iterator[Any]:
    """Each JSON object of a streamed answer: dockerd writes one per line (pull progress, events).

    ``read1`` returns what has arrived (http.client undoes the chunked encoding), so an event is
    seen as soon as dockerd sends it.
    """
    pending = b""
    while chunk := response.read1(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if pending.strip():
        yield json.loads(pending)


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
            for event in _json_objects(self._response):
                if isinstance(event, dict):
                    yield event
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


class DockerAPI:
    """The Engine API at ``socket_path``, in the version dockerd speaks (asked once)."""

    def __init__(self, socket_path: str = DOCKER_SOCKET, timeout: float = TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.api_version: str | None = None  # the version spoken, once negotiated
        self.daemon_versions: tuple[str | None, str] | None = None  # dockerd's (minimum, newest)

    # ------------------------------------------------------------------ calls

    def ping(self) -> str:
        """Negotiate the API version with dockerd, return it (:class:`Unreachable` if it is not there)."""
        answer = self._call("GET", "/version", versioned=False)
        info = answer if isinstance(answer, dict) else {}
        newest, oldest = info.get("ApiVersion"), info.get("MinAPIVersion")
        if not isinstance(newest, str) or not _VERSION.fullmatch(newest):
            raise DockerError(f"dockerd gave no usable ApiVersion in GET /version: {answer!r:.200}")
        if not isinstance(oldest, str) or not _VERSION.fullmatch(oldest):
            oldest = None  # an engine that does not say has no minimum above tpuboot's
        self.daemon_versions = (oldest, newest)
        self.api_version = negotiate(newest, oldest)
        return self.api_version

    def inspect_container(self, name: str) -> dict[str, Any]:
        """``docker inspect`` data of a container (by name or id); :class:`NotFound` if absent."""
        return self._call("GET", f"/containers/{_quote(name)}/json")

    def create_container(self, name: str, config: dict[str, Any]) -> str:
        """Create ``name`` from an Engine API container config (``Image``, ``HostConfig``...); its id."""
        answer = self._call("POST", "/containers/create", {"name": name}, body=config)
        if not isinstance(answer, dict) or not answer.get("Id"):
            raise DockerError(f"dockerd created {name} but gave no Id: {answer!r:.200}")
        return str(answer["Id"])

    def start_container(self, ident: str) -> None:
        """Start it; one already running (304) is fine."""
        self._call("POST", f"/containers/{_quote(ident)}/start")

    def remove_container(self, ident: str, force: bool = False) -> None:
        self._call("DELETE", f"/containers/{_quote(ident)}", {"force": str(force).lower()})

    def inspect_image(self, name: str) -> dict[str, Any]:
        """The image's data; :class:`NotFound` if dockerd does not have it."""
        return self._call("GET", f"/images/{_quote(name)}/json")

    def pull_image(self, repository: str, tag: str) -> None:
        """Pull ``repository`` at ``tag`` (a tag or a ``sha256:`` digest), to the end of the stream.

        dockerd answers 200 before it knows; a failure is an ``error`` object in the stream.
        """
        conn, response = self._open("POST", "/images/create", {"fromImage": repository, "tag": tag})
        try:
            for message in _json_objects(response):
                if isinstance(message, dict) and (message.get("error") or message.get("errorDetail")):
                    detail = message.get("errorDetail") or {}
                    text = message.get("error") or (detail.get("message") if isinstance(detail, dict) else "")
                    raise APIError(response.status, str(text or detail))
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{self.socket_path}: pull cut short ({_why(exc)})") from exc
        except ValueError as exc:
            raise DockerError(f"dockerd sent malformed pull progress: {exc}") from exc
        finally:
            conn.close()

    def events(self, filters: dict[str, list[str]]) -> EventStream:
        """Follow dockerd's events that match ``filters`` (e.g. ``{"event": ["die"]}``), no timeout."""
        query = {"filters": json.dumps(filters, separators=(",", ":"))}
        conn, response = self._open("GET", "/events", query, stream=True)
        if conn.unix_sock is None:  # cannot be: there is an answer
            conn.close()
            raise Unreachable(f"{self.socket_path}: no socket for the events stream")
        return EventStream(conn.unix_sock, response)

    # ------------------------------------------------------------------ transport

    def _path(self, path: str, versioned: bool) -> str:
        if not versioned:
            return path
        if self.api_version is None:
            self.ping()
        return f"/v{self.api_version}{path}"

    def _open(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        body: Any = None,
        *,
        versioned: bool = True,
        stream: bool = False,
    ) -> tuple[_UnixConnection, http.client.HTTPResponse]:
        """Send one request on a new connection; the answer if it is a success, else raise.

        A ``stream`` has no timeout: events come when they come.
        """
        for attempt in (1, 2):
            url = self._path(path, versioned) + (f"?{urlencode(query)}" if query else "")
            headers = {"Content-Type": "application/json"} if body is not None else {}
            data = json.dumps(body).encode() if body is not None else None
            conn = _UnixConnection(self.socket_path, None if stream else self.timeout)
            try:
                conn.request(method, url, body=data, headers=headers)
                response = conn.getresponse()
                if response.status < 400:
                    return conn, response
                error = _api_error(response.status, response.read(MAX_BODY))
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise Unreachable(f"{self.socket_path}: {_why(exc)}") from exc
            conn.close()
            # Refused before it did anything (dockerd's version check comes first): safe to resend.
            if not (versioned and attempt == 1 and error.status == 400 and _REFUSED.match(error.explanation)):
                raise error
            self.ping()
        raise AssertionError("unreachable")  # the loop returns or raises

    def _call(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        body: Any = None,
        *,
        versioned: bool = True,
    ) -> Any:
        """One request and its whole JSON answer (None when there is no body: 204, 304)."""
        conn, response = self._open(method, path, query, body, versioned=versioned)
        try:
            data = response.read(MAX_BODY)
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{self.socket_path}: {_why(exc)}") from exc
        finally:
            conn.close()
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise DockerError(f"dockerd sent malformed JSON for {method} {path}: {exc}") from exc


def _why(exc: BaseException) -> str:
    """An exception's message, or its type when it has none (``IncompleteRead(b'')``...)."""
    return str(exc) or type(exc).__name__


def _quote(name: str) -> str:
    """A container or image name in a path: ``/`` ``:`` ``@`` stay (dockerd routes on them)."""
    return quote(name, safe="/:@")
