"""A small Docker Engine API client over dockerd's unix socket, on the standard library alone.

Only the calls tpuboot's container supervision needs (:mod:`tpuboot.containers.docker` holds the
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
  connection. The events stream has no timeout once its headers came; every other call has
  one, and it holds in wall-clock time (:class:`tpuboot.netio.DeadlineSocket`): a dockerd that
  trickles an answer a byte at a time cannot hold a call past it. A pull streams for as long
  as the image takes, each read within ``timeout``, the whole within ``pull_timeout``.
- What dockerd sends is bounded and checked (:mod:`tpuboot.containers.dockerwire`): a line of
  a stream over ``MAX_LINE``, a line that is not JSON, a body shorter than its Content-Length
  or over :data:`MAX_BODY`, a Content-Length that is not ASCII digits, a broken chunked
  encoding: each is a one-line
  :class:`ProtocolError` (an :class:`Unreachable`: the caller drops the connection and comes
  back later), read in bounded memory.
- An HTTP error answer is an :class:`APIError` with dockerd's own ``message``; 404 is
  :class:`NotFound`. A pull that fails answers 200 and reports the failure inside the stream:
  that is an :class:`APIError` too.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import time
from typing import Any
from urllib.parse import quote, urlencode

from tpuboot.containers.dockerwire import (
    MAX_ERROR_BODY,
    APIError,
    DockerError,
    EventStream,
    ProtocolError,
    UnixConnection,
    Unreachable,
    api_error,
    json_objects,
    read_body,
    why,
)
from tpuboot.containers.engine import RegistryAuth

DOCKER_SOCKET = "/run/docker.sock"
#: Where Debian's and Ubuntu's docker.io (/usr/sbin) and Docker's docker-ce (/usr/bin) put dockerd.
DOCKERD = ("/usr/sbin/dockerd", "/usr/bin/dockerd")


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
_VERSION = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")  # ASCII: in a str pattern \d is any Unicode digit
#: dockerd's refusal of a version outside its range (API middleware), HTTP 400.
_REFUSED = re.compile(r"client version \S+ is too (old|new)")
TIMEOUT = 60.0
#: The whole of a pull, however steadily it progresses (each read has ``timeout``).
PULL_TIMEOUT = 3600.0
#: Cap on a plain (not streamed) answer: inspect data is a few KiB.
MAX_BODY = 16 << 20


#: The header of a pull's credentials (the Engine API's ``AuthConfig``, base64url JSON).
AUTH_HEADER = "X-Registry-Auth"


def auth_header(auth: RegistryAuth) -> str:
    """The ``X-Registry-Auth`` value (the Engine API's ``AuthConfig``): base64url of the JSON,
    padded, as Docker's client sends it. Debian 12's dockerd (20.10) reads a header it cannot
    decode as no credentials at all, without a word, so the encoding is the one its decoder takes
    (``base64.URLEncoding``)."""
    data = {"username": auth.username, "password": auth.password, "serveraddress": auth.registry}
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode("ascii")


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


class DockerAPI:
    """The Engine API at ``socket_path``, in the version dockerd speaks (asked once)."""

    def __init__(
        self,
        socket_path: str = DOCKER_SOCKET,
        timeout: float = TIMEOUT,
        pull_timeout: float = PULL_TIMEOUT,
        max_body: int = MAX_BODY,
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.pull_timeout = pull_timeout
        self.max_body = max_body  # a JSON answer longer than this is refused
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
        return _object(self._call("GET", f"/containers/{_quote(name)}/json"), f"inspect of {name}")

    def create_container(self, name: str, config: dict[str, Any]) -> str:
        """Create ``name`` from an Engine API container config (``Image``, ``HostConfig``...); its id."""
        answer = self._call("POST", "/containers/create", {"name": name}, body=config)
        if not isinstance(answer, dict) or not answer.get("Id"):
            raise DockerError(f"dockerd created {name} but gave no Id: {answer!r:.200}")
        return str(answer["Id"])

    def start_container(self, ident: str) -> None:
        """Start it; one already running (304) is fine."""
        self._call("POST", f"/containers/{_quote(ident)}/start")

    def kill_container(self, ident: str) -> None:
        """SIGKILL to its process; one not running (409) is fine: it has ended already."""
        try:
            self._call("POST", f"/containers/{_quote(ident)}/kill")
        except APIError as exc:
            if exc.status != 409:
                raise

    def remove_container(self, ident: str, force: bool = False) -> None:
        self._call("DELETE", f"/containers/{_quote(ident)}", {"force": str(force).lower()})

    def list_containers(self, filters: dict[str, list[str]]) -> list[dict[str, Any]]:
        """``docker ps -a --filter``: every container matching ``filters``, running or not."""
        query = {"all": "true", "filters": json.dumps(filters, separators=(",", ":"))}
        answer = self._call("GET", "/containers/json", query)
        if not isinstance(answer, list):
            raise DockerError(f"dockerd listed containers as {answer!r:.200}")
        return [item for item in answer if isinstance(item, dict)]

    def inspect_image(self, name: str) -> dict[str, Any]:
        """The image's data; :class:`NotFound` if dockerd does not have it."""
        return _object(self._call("GET", f"/images/{_quote(name)}/json"), f"inspect of image {name}")

    def pull_image(self, repository: str, tag: str, auth: RegistryAuth | None = None) -> None:
        """Pull ``repository`` at ``tag`` (a tag or a ``sha256:`` digest), to the end of the stream.

        ``auth``: the registry's credentials, sent in the request's ``X-Registry-Auth`` header
        (dockerd gives them to that registry when it asks); None pulls anonymously.
        dockerd answers 200 before it knows; a failure is an ``error`` object in the stream.
        """
        query = {"fromImage": repository, "tag": tag}
        headers = {AUTH_HEADER: auth_header(auth)} if auth is not None else None
        conn, response = self._open("POST", "/images/create", query, total=self.pull_timeout, headers=headers)
        try:
            for message in json_objects(response, "pull progress"):
                if isinstance(message, dict) and (message.get("error") or message.get("errorDetail")):
                    detail = message.get("errorDetail") or {}
                    text = message.get("error") or (detail.get("message") if isinstance(detail, dict) else "")
                    raise APIError(response.status, str(text or detail))
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{self.socket_path}: pull cut short ({why(exc)})") from exc
        finally:
            conn.close()

    def events(self, filters: dict[str, list[str]]) -> EventStream:
        """Follow dockerd's events that match ``filters`` (e.g. ``{"event": ["die"]}``), no timeout."""
        query = {"filters": json.dumps(filters, separators=(",", ":"))}
        conn, response = self._open("GET", "/events", query)  # the headers within the timeout
        if conn.unix_sock is None:  # cannot be: there is an answer
            conn.close()
            raise Unreachable(f"{self.socket_path}: no socket for the events stream")
        conn.deadline = None  # then events come when they come
        conn.unix_sock.settimeout(None)
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
        total: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[UnixConnection, http.client.HTTPResponse]:
        """Send one request on a new connection; the answer if it is a success, else raise.

        Each read waits ``timeout`` at most and the whole exchange, body included, ends within
        ``total`` (default: ``timeout``) of its start; the caller may lift that for a stream.
        """
        for attempt in (1, 2):
            url = self._path(path, versioned) + (f"?{urlencode(query)}" if query else "")
            sent = {"Content-Type": "application/json"} if body is not None else {}
            sent.update(headers or {})
            data = json.dumps(body).encode() if body is not None else None
            deadline = time.monotonic() + (self.timeout if total is None else total)
            conn = UnixConnection(self.socket_path, self.timeout, deadline)
            try:
                conn.request(method, url, body=data, headers=sent)
                response = conn.getresponse()
                if response.status < 400:
                    return conn, response
                error = api_error(response.status, read_body(response, MAX_ERROR_BODY, f"{method} {path}"))
            except ProtocolError:
                conn.close()
                raise
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise Unreachable(f"{self.socket_path}: {why(exc)}") from exc
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
            data = read_body(response, self.max_body, f"{method} {path}")
        except ProtocolError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{self.socket_path}: {why(exc)}") from exc
        finally:
            conn.close()
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise ProtocolError(
                f"dockerd sent an answer to {method} {path} that is not JSON: {data[:60]!r}"
            ) from None


def _object(answer: Any, what: str) -> dict[str, Any]:
    """A JSON answer that must be an object: anything else is a protocol error, not a crash later."""
    if not isinstance(answer, dict):
        raise ProtocolError(f"dockerd answered the {what} with {type(answer).__name__}, not an object")
    return answer


def _quote(name: str) -> str:
    """A container or image name in a path: ``/`` ``:`` ``@`` stay (dockerd routes on them)."""
    return quote(name, safe="/:@")
