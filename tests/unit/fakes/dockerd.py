"""A fake dockerd: the Engine API subset tpuboot uses, served over HTTP on a unix socket.

Real HTTP/1.1 on a real ``AF_UNIX`` socket (chunked streams included), so the tests drive
:mod:`tpuboot.containers.dockerapi` as dockerd would answer it. It records every request and can be told
to have or not have a container or an image, fail a pull inside a 200 stream (as dockerd does),
send a container's ``die`` event, end the event streams cleanly, or go away (``stop``: the
socket is removed, streams are cut, containers stop as at a dockerd restart).

It speaks one API version (``api_version``) and refuses others below ``min_api_version`` or
above its own, with dockerd's messages (HTTP 400, from its version middleware, before any
route), so a client that does not negotiate fails here. :data:`ENGINES` holds the ends tpuboot
meets: Debian 12's docker.io 20.10 (API 1.41, minimum 1.12), Docker 29 (Ubuntu's docker.io in
jammy and noble updates, and docker-ce: API 1.52, minimum 1.44), and an engine newer than any
tpuboot knows. Assigning ``api_version``/``min_api_version`` while it runs is an upgrade under
a running client.

Faults, for a dockerd that misbehaves rather than goes away: ``raw_answer`` (these bytes answer
every request as they are: short bodies, odd Content-Lengths, broken chunking), ``trickle``
(every answer's status line and a header that never ends, a byte per ``trickle`` seconds),
``event_preamble`` (raw bytes, chunk framing included or broken, that open each event stream)
and ``event_flood`` (that many bytes without a newline open each event stream).

Registries that require credentials: ``registry_credentials[host] = (username, password)``.
A pull's ``X-Registry-Auth`` header is decoded as dockerd decodes it (base64url with padding,
then JSON; a header it cannot decode counts as none, as Debian 12's dockerd 20.10 does without
a word) and kept in ``pull_auths``; a pull from such a host without that pair is refused as
dockerd relays the registry's 401, before any progress.
"""

from __future__ import annotations

import base64
import binascii
import http.server
import itertools
import json
import queue
import re
import select
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

END = "end"  # a clean end of an event stream (the terminating chunk)
CUT = "cut"  # the connection dropped (dockerd died)


@dataclass
class Request:
    method: str
    path: str  # as sent, with the /v1.xx prefix
    query: dict[str, str]
    body: Any
    version: str | None  # the /v1.xx prefix, None if unversioned
    headers: dict[str, str] = field(default_factory=dict)
    # Set once its answer is written (a stream's, when the stream ends): a test can wait for what
    # the client was told, not only for what it asked.
    answered: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


@dataclass
class Subscriber:
    filters: dict[str, set[str]]
    items: queue.Queue[dict[str, Any] | str] = field(default_factory=queue.Queue)
    closed_by_client: threading.Event = field(default_factory=threading.Event)


#: name -> (api_version, min_api_version, engine version), as each engine's GET /version says.
ENGINES = {
    "debian12": ("1.41", "1.12", "20.10.24+dfsg1"),
    "docker29": ("1.52", "1.44", "29.1.3"),
    "future": ("1.61", "1.44", "33.0.0"),
}


#: dockerd's status for a pull the registry refused (it answers before any progress).
REFUSED_STATUS = 401
_BASE64URL = re.compile(r"(?:[A-Za-z0-9_-]{4})*(?:[A-Za-z0-9_-]{2}==|[A-Za-z0-9_-]{3}=)?")


def decode_registry_auth(header: str | None) -> dict[str, Any] | None:
    """An ``X-Registry-Auth`` value as dockerd reads it (Go's ``base64.URLEncoding``: the URL-safe
    alphabet, padding required, then a JSON object); None when dockerd would find no credentials."""
    if not header or not _BASE64URL.fullmatch(header):
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(header))
    except (binascii.Error, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    fake: FakeDockerd


class FakeDockerd:
    def __init__(
        self,
        socket_path: Path,
        api_version: str = "1.41",
        min_api_version: str | None = "1.12",
        engine_version: str = "20.10.24+dfsg1",
    ) -> None:
        self.socket_path = socket_path
        self.root = socket_path.parent  # a root tree holding it at /run/docker.sock, in fake_dockerd
        self.api_version = api_version
        self.min_api_version = min_api_version  # None: GET /version has no MinAPIVersion (old engines)
        self.engine_version = engine_version
        self.containers: dict[str, dict[str, Any]] = {}  # by name
        self.images: set[str] = set()
        self.pull_error: str | None = None
        #: Ids of containers containerd still has a task for (left by a dockerd restart): their start
        #: fails, as dockerd's does, until the container is removed.
        self.stale_tasks: set[str] = set()
        self.stale_message: str | None = None  # the start's error message for them (None: dockerd's)
        self.pulls: list[tuple[str, str]] = []
        self.pull_auths: list[dict[str, Any] | None] = []  # each pull's decoded X-Registry-Auth
        self.registry_credentials: dict[str, tuple[str, str]] = {}  # host -> the pair it takes
        self.requests: list[Request] = []
        self.subscribers: list[Subscriber] = []  # every event stream opened, in order
        self.on_pull: Callable[[], None] | None = None  # runs inside each pull
        self.raw_answer: bytes | None = None
        self.trickle = 0.0
        self.event_preamble: bytes | None = None
        self.event_flood = 0
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server: _Server | None = None

    # ------------------------------------------------------------------ life

    def start(self) -> FakeDockerd:
        """Listen (again: containers and images survive a restart, like dockerd's)."""
        self.socket_path.unlink(missing_ok=True)
        self.stopped.clear()
        server = _Server(str(self.socket_path), _Handler)
        server.fake = self
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def stop(self) -> None:
        """dockerd goes away: no socket, every stream cut, every container stopped."""
        server, self._server = self._server, None
        self.stopped.set()
        if server is not None:
            server.shutdown()
            server.server_close()
        self.socket_path.unlink(missing_ok=True)
        with self.lock:
            for container in self.containers.values():
                if container["State"]["Running"]:
                    container["State"] = {"Running": False, "ExitCode": 0, "Status": "exited"}
            for subscriber in self.subscribers:
                subscriber.items.put(CUT)

    @property
    def up(self) -> bool:
        return self._server is not None

    # ------------------------------------------------------------------ what tests set and read

    def add_container(
        self,
        name: str,
        image: str,
        labels: dict[str, str] | None = None,
        privileged: bool = True,
        network_mode: str = "host",
        running: bool = True,
    ) -> str:
        config = {
            "Image": image,
            "Labels": labels or {},
            "HostConfig": {"Privileged": privileged, "NetworkMode": network_mode},
        }
        with self.lock:
            ident = self._create(name, config)
            self.containers[name]["State"] = {"Running": running, "ExitCode": 0, "Status": "running"}
        return ident

    def die(self, name: str, code: int) -> None:
        """The container's process ends: its state, and a ``die`` event to matching streams."""
        with self.lock:
            container = self.containers[name]
            container["State"] = {"Running": False, "ExitCode": code, "Status": "exited"}
            event = {
                "Type": "container",
                "Action": "die",
                "Actor": {"ID": container["Id"], "Attributes": {"exitCode": str(code), "name": name}},
                "scope": "local",
                "time": int(time.time()),
                "timeNano": time.time_ns(),
            }
            if _version(self.api_version) < (1, 52):  # the deprecated fields, as old engines send them
                event.update(status="die", id=container["Id"], **{"from": container["Config"]["Image"]})
            for subscriber in self.subscribers:
                if self._matches(subscriber.filters, event, name):
                    subscriber.items.put(event)

    def end_event_streams(self) -> None:
        with self.lock:
            for subscriber in self.subscribers:
                subscriber.items.put(END)

    def paths(self, method: str | None = None) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests if method in (None, r.method)]

    def calls(self, method: str, pattern: str) -> list[Request]:
        """Requests of ``method`` whose unversioned path matches ``pattern`` (a regex)."""
        with self.lock:
            return [
                r
                for r in self.requests
                if r.method == method and re.fullmatch(pattern, re.sub(r"^/v[\d.]+", "", r.path))
            ]

    def running(self, name: str) -> bool:
        with self.lock:
            return bool(self.containers[name]["State"]["Running"])

    def image_of(self, name: str) -> str | None:
        """The image of container ``name``, None while there is none (between remove and create)."""
        with self.lock:
            container = self.containers.get(name)
            return container["Config"]["Image"] if container else None

    # ------------------------------------------------------------------ the engine (handler threads)

    def _create(self, name: str, config: dict[str, Any]) -> str:
        ident = f"{next(self._ids):064x}"
        self.containers[name] = {
            "Id": ident,
            "Name": "/" + name,
            "Config": {"Image": config.get("Image"), "Labels": config.get("Labels") or {}},
            "HostConfig": {
                "Privileged": bool((config.get("HostConfig") or {}).get("Privileged")),
                "NetworkMode": (config.get("HostConfig") or {}).get("NetworkMode") or "bridge",
                "Binds": (config.get("HostConfig") or {}).get("Binds"),
            },
            "State": {"Running": False, "ExitCode": 0, "Status": "created"},
        }
        return ident

    def _find(self, key: str) -> dict[str, Any] | None:
        if key in self.containers:
            return self.containers[key]
        for container in self.containers.values():
            if len(key) >= 12 and container["Id"].startswith(key):
                return container
        return None

    @staticmethod
    def _matches(filters: dict[str, set[str]], event: dict[str, Any], name: str) -> bool:
        wanted = {
            "type": {event["Type"]},
            "event": {event["Action"]},
            "container": {event["Actor"]["ID"], name},
        }
        return all(values & wanted.get(key, set()) for key, values in filters.items())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # the client address of AF_UNIX is ""
        pass

    def do_GET(self) -> None:
        self._answered("GET")

    def do_POST(self) -> None:
        self._answered("POST")

    def do_DELETE(self) -> None:
        self._answered("DELETE")

    def _answered(self, method: str) -> None:
        self.seen: Request | None = None
        try:
            self._route(method)
        finally:
            if self.seen is not None:
                self.seen.answered.set()

    # ------------------------------------------------------------------ answers

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if status not in (204, 304):
            self.send_header("Content-Type", "application/json" if body is not None else "text/plain")
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if status not in (204, 304):
            self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"message": message})

    def _stream_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, obj: Any, newline: bytes = b"\n") -> None:
        """One JSON object in one chunk; dockerd ends events with \\n, pull progress with \\r\\n."""
        data = json.dumps(obj).encode() + newline
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _stream_end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    # ------------------------------------------------------------------ routes

    def _route(self, method: str) -> None:
        fake = self.server.fake
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = unquote(url.path)
        version = None
        if match := re.fullmatch(r"/v(\d+\.\d+)(/.*)", path):
            version, path = match.groups()
        self.seen = Request(method, url.path, query, body, version, dict(self.headers.items()))
        with fake.lock:
            fake.requests.append(self.seen)
        if fake.raw_answer is not None:
            self.close_connection = True
            self.wfile.write(fake.raw_answer)
            return None
        if fake.trickle:
            self.close_connection = True
            self._trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: ")
            while not fake.stopped.is_set():
                self._trickle(b"a")
            return None
        minimum = fake.min_api_version or "1.12"  # what engines that did not say accepted
        if version is not None and _version(version) < _version(minimum):
            return self._error(
                400,
                f"client version {version} is too old. Minimum supported API version is "
                f"{minimum}, please upgrade your client to a newer version",
            )
        if version is not None and _version(version) > _version(fake.api_version):
            return self._error(
                400,
                f"client version {version} is too new. Maximum supported API version is {fake.api_version}",
            )
        headers = {"API-Version": fake.api_version}
        if (method, path) == ("GET", "/_ping"):
            return self._send(200, b"OK", headers)
        if (method, path) == ("GET", "/version"):
            answer = {
                "Version": fake.engine_version,
                "ApiVersion": fake.api_version,
                "MinAPIVersion": fake.min_api_version,
                "Os": "linux",
                "Arch": "amd64",
            }
            if fake.min_api_version is None:
                del answer["MinAPIVersion"]
            return self._send(200, answer, headers)
        if (method, path) == ("GET", "/events"):
            return self._events(query)
        if (method, path) == ("POST", "/images/create"):
            return self._pull(query, self.headers.get("X-Registry-Auth"))
        if (method, path) == ("POST", "/containers/create"):
            return self._create(query, body)
        if method == "GET" and (match := re.fullmatch(r"/images/(.+)/json", path)):
            with fake.lock:
                present = match.group(1) in fake.images
            if present:
                return self._send(200, {"Id": "sha256:" + "0" * 64, "RepoTags": [match.group(1)]})
            return self._error(404, f"No such image: {match.group(1)}")
        if (method, path) == ("GET", "/containers/json"):
            return self._list(query)
        if match := re.fullmatch(r"/containers/([^/]+)(/json|/start|/kill)?", path):
            return self._container(method, match.group(1), match.group(2) or "", query)
        return self._error(404, f"page not found: {method} {path}")

    def _trickle(self, data: bytes) -> None:
        for byte in data:
            if self.server.fake.stopped.wait(self.server.fake.trickle):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    def _container(self, method: str, key: str, action: str, query: dict[str, str]) -> None:
        fake = self.server.fake
        killed = ""
        with fake.lock:
            container = fake._find(key)
            if container is None:
                status, answer = 404, {"message": f"No such container: {key}"}
            elif (method, action) == ("GET", "/json"):
                status, answer = 200, json.loads(json.dumps(container))
            elif (method, action) == ("POST", "/start"):
                if container["State"]["Running"]:
                    status, answer = 304, None
                elif container["Id"] in fake.stale_tasks:
                    task = f"task {container['Id']}: already exists: unknown"
                    message = fake.stale_message or f"failed to create task for container: {task}"
                    status, answer = 500, {"message": message}
                else:
                    container["State"] = {"Running": True, "ExitCode": 0, "Status": "running"}
                    status, answer = 204, None
            elif (method, action) == ("POST", "/kill"):
                if not container["State"]["Running"]:
                    status, answer = 409, {"message": f"Container {key} is not running"}
                else:
                    status, answer = 204, None
                    killed = container["Name"][1:]
            elif (method, action) == ("DELETE", ""):
                if container["State"]["Running"] and query.get("force") not in ("1", "true", "True"):
                    status, answer = 409, {"message": "You cannot remove a running container. Stop it first"}
                else:
                    del fake.containers[container["Name"][1:]]
                    status, answer = 204, None
            else:
                status, answer = 405, {"message": "method not allowed"}
        if killed:
            fake.die(killed, 137)  # SIGKILL's exit, as dockerd reports it
        self._send(status, answer)

    def _list(self, query: dict[str, str]) -> None:
        """``docker ps -a``: label filters only (``key=value`` or ``key``)."""
        labels = json.loads(query.get("filters") or "{}").get("label", [])
        with self.server.fake.lock:
            found = [
                {
                    "Id": c["Id"],
                    "Names": [c["Name"]],
                    "Image": c["Config"]["Image"],
                    "Labels": c["Config"]["Labels"],
                }
                for c in self.server.fake.containers.values()
                if all(
                    (c["Config"]["Labels"] or {}).get(k) == v if eq else k in (c["Config"]["Labels"] or {})
                    for k, eq, v in (label.partition("=") for label in labels)
                )
            ]
        self._send(200, found)

    def _create(self, query: dict[str, str], body: Any) -> None:
        fake = self.server.fake
        name = query.get("name", "")
        with fake.lock:
            if not isinstance(body, dict) or not body.get("Image"):
                status, answer = 400, {"message": "config is missing the Image"}
            elif body["Image"] not in fake.images:
                status, answer = 404, {"message": f"No such image: {body['Image']}"}
            elif name in fake.containers:
                status, answer = 409, {"message": f'Conflict. The container name "/{name}" is already in use'}
            else:
                status, answer = 201, {"Id": fake._create(name, body), "Warnings": []}
        self._send(status, answer)

    def _pull(self, query: dict[str, str], header: str | None) -> None:
        fake = self.server.fake
        repository, tag = query.get("fromImage", ""), query.get("tag", "")
        auth = decode_registry_auth(header)
        host = repository.split("/")[0]
        with fake.lock:
            fake.pulls.append((repository, tag))
            fake.pull_auths.append(auth)
            error = fake.pull_error
            wanted = fake.registry_credentials.get(host)
        given = ((auth or {}).get("username"), (auth or {}).get("password"))
        if wanted is not None and given != wanted:
            # What Debian 12's dockerd says (seen in tests/vm/test_tpuboot_registry.py).
            manifest = f'Head "https://{host}/v2/{repository[len(host) + 1 :]}/manifests/{tag}"'
            what = (
                "unauthorized: authentication required" if auth else f"{manifest}: no basic auth credentials"
            )
            return self._error(REFUSED_STATUS, what)
        if fake.on_pull is not None:
            fake.on_pull()
        self._stream_start()
        self._chunk({"status": f"Pulling from {repository}", "id": tag}, b"\r\n")
        if error is not None:  # dockerd: the answer is already 200 when the registry fails
            self._chunk({"errorDetail": {"message": error}, "error": error}, b"\r\n")
        else:
            progress = {"status": "Downloading", "progressDetail": {"current": 1, "total": 2}, "id": "x"}
            self._chunk(progress, b"\r\n")
            self._chunk({"status": f"Status: Downloaded newer image for {repository}:{tag}"}, b"\r\n")
            with fake.lock:
                fake.images.add(f"{repository}@{tag}" if tag.startswith("sha256:") else f"{repository}:{tag}")
        self._stream_end()

    def _events(self, query: dict[str, str]) -> None:
        fake = self.server.fake
        try:
            raw = json.loads(query.get("filters") or "{}")
            filters = {key: set(values) for key, values in raw.items()}
        except (ValueError, TypeError, AttributeError):
            return self._error(400, "invalid filter")
        subscriber = Subscriber(filters)
        with fake.lock:
            fake.subscribers.append(subscriber)
        self._stream_start()
        try:
            if fake.event_preamble is not None:
                self.wfile.write(fake.event_preamble)
            flood = fake.event_flood
            while flood > 0 and not fake.stopped.is_set():  # no newline: the client must give up
                piece = b"x" * min(flood, 65536)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                flood -= len(piece)
            while True:
                try:
                    item = subscriber.items.get(timeout=0.01)
                except queue.Empty:
                    if self._client_gone():
                        subscriber.closed_by_client.set()
                        return
                    continue
                if item == END:
                    return self._stream_end()
                if item == CUT:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._chunk(item)
        except OSError:
            subscriber.closed_by_client.set()
            self.close_connection = True

    def _client_gone(self) -> bool:
        readable, _, _ = select.select([self.connection], [], [], 0)
        return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""


@contextmanager
def fake_dockerd(
    api_version: str = "1.41", min_api_version: str | None = "1.12", engine_version: str = "20.10.24+dfsg1"
) -> Iterator[FakeDockerd]:
    """A running fake dockerd at ``<root>/run/docker.sock``, ``root`` a short temporary directory
    (a unix socket path has room for ~107 bytes; ``Root(fake.root)`` finds it where tpuboot looks).
    ``fake_dockerd(*ENGINES["docker29"])`` is Docker 29.
    """
    root = Path(tempfile.mkdtemp(prefix="fakedockerd-"))
    (root / "run").mkdir()
    fake = FakeDockerd(root / "run" / "docker.sock", api_version, min_api_version, engine_version)
    fake.root = root
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()
        shutil.rmtree(root)
