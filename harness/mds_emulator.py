"""A GCE metadata server emulator: a real HTTP server for tests, benchmarks and VM guests.

Serves ``/computeMetadata/v1/instance/attributes/<k>``, ``/project/attributes/<k>`` and
``/instance/<path>`` from a dict that can change while it runs (a change wakes waiting
long-polls), with the real server's semantics: the request must carry ``Metadata-Flavor:
Google`` (else 403), every answer carries it, ``ETag`` on values, 404 for a missing key,
``wait_for_change``/``last_etag``/``timeout_sec`` long-polls of values and of directories (woken
by a change under the directory), directory listings, ``?recursive=true`` as nested JSON, and
repeated slashes read as one (google-guest-agent polls ``/computeMetadata/v1//?recursive=true``).
The notice keys as a VM sees them (``instance/maintenance-event`` ``NONE``, ``instance/preempted``
``FALSE``, ``instance/upcoming-maintenance`` absent) until :meth:`MetadataEmulator.announce`
changes them. Guest attributes as the real server keeps them: ``PUT``, ``GET`` and
``DELETE`` of ``/instance/guest-attributes/<namespace>/<key>`` when ``enable-guest-attributes``
is true on the instance (else on the project), and 403 "Guest attributes endpoint access is
disabled." for every guest-attributes request otherwise. Faults (``Faults``) are injectable at
run time. Every request is counted with its time, for the fleet benchmark; with
``log_requests`` (``--log-requests``) each is also written to stderr with its answer's status.

Standalone (for VM guests)::

    python3 harness/mds_emulator.py --port 8080 --attributes attrs.yaml [--error-rate 0.2]

``attrs.yaml`` maps attribute names to values; a mapping value (like ``tpu-env``) is
served as its YAML text. Control endpoints, not counted and without flavor checks:
``GET /_emulator/stats`` (JSON), ``PUT /_emulator/v1/<path>`` (body = new value; DELETE
removes it) and ``PUT /_emulator/faults`` (body = JSON object of ``Faults`` fields). The stats
count guest-attribute writes apart (``guest_attribute_writes``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

ROOT = "/computeMetadata/v1/"
CONTROL = "/_emulator/"
GUEST_ATTRIBUTES = "instance/guest-attributes/"
ENABLE_GUEST_ATTRIBUTES = "enable-guest-attributes"
#: The real server's answer, with 403, to guest-attributes requests on an instance without them.
GUEST_ATTRIBUTES_DISABLED = "Guest attributes endpoint access is disabled.\n"
_GUEST_ATTRIBUTE_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")  # gcloud's query-path pattern: [\w-]+

#: Values a tpu-env could hold that break naive quoting, evaluation or parsing.
HOSTILE_VALUES = {
    "DQUOTE": 'say "hi"',
    "SQUOTE": "it's",
    "DOLLAR_CMD": "$(touch /tmp/tpuboot-pwned)",
    "BACKTICK": "`touch /tmp/tpuboot-pwned`",
    "VARIABLE": "${HOME} and $PATH",
    "BACKSLASH": "a\\b\\",
    "BACKSLASH_NEWLINE": "a\\\nb",
    "NEWLINE": "line one\nline two",
    "TRAILING_NEWLINE": "x\n",
    "CARRIAGE_RETURN": "a\rb",
    "TAB": "a\tb",
    "SEMICOLON": "x; rm -rf /",
    "UNICODE": "zoné ☃ 日本 😀",
    "EMPTY": "",
    "SPACES": "  padded  ",
    "EQUALS": "a=b=c",
    "HASH": "# not a comment",
    "BANG": "!!1",
}

#: A realistic tpu-env (keys seen on real TPU VMs).
SAMPLE_TPU_ENV = {
    "ACCELERATOR_TYPE": "v5p-8",
    "TYPE": "V5P",
    "TOPOLOGY": "2x2x1",
    "WORKER_ID": "0",
    "NODE_ID": "tpu-node-1",
    "ZONE": "us-east5-a",
    "CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "HOST_BOUNDS": "1,1,1",
    "WRAP": "false,false,false",
    "ALT": "false",
    "TPU_RUNTIME_METRICS_PORTS": "8431,8432,8433,8434",
    "ENABLE_ICI_RESILIENCY": "true",
    "INJECT_SLICE_BUILDER_FAULT": "",
    "VBARCONTROL_AGENT_DOCKER_URL": "example.invalid/vbar:1.0",
}

#: Billion laughs: a few hundred bytes that expand to 10**9 items if aliases are expanded.
ALIAS_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]
    + ["BOMB: *i"]
)

INVALID_YAML = "ACCELERATOR_TYPE: 'v5p-8\nTOPOLOGY: [2x2\n  : :\n"

#: The notice keys as the real server holds them on a VM nothing is happening to:
#: ``instance/upcoming-maintenance`` is absent until maintenance is scheduled (:meth:`announce`).
NOTICE_DEFAULTS = {"instance/maintenance-event": "NONE", "instance/preempted": "FALSE"}
UPCOMING_MAINTENANCE = "instance/upcoming-maintenance"


def yaml_quote(text: str) -> str:
    """``text`` as a YAML double-quoted scalar that loads back exactly (PyYAML's dumper folds some breaks)."""
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def tpu_env_yaml(values: Mapping[str, Any]) -> str:
    """The YAML text of a tpu-env attribute holding ``values`` (strings kept exactly, others as YAML)."""
    lines = []
    for key, value in values.items():
        text = (
            yaml_quote(value)
            if isinstance(value, str)
            else yaml.safe_dump(value, default_flow_style=True).strip()
        )
        lines.append(f"{yaml_quote(str(key))}: {text}\n")
    return "".join(lines)


@dataclass(frozen=True)
class Faults:
    """What goes wrong; replace the emulator's ``faults`` at any time."""

    error_rate: float = 0.0  # fraction of requests answered with error_status
    error_status: int = 503
    status: int | None = None  # answer every request with this status
    delay: float = 0.0  # seconds before answering
    drop: bool = False  # send the headers and half the body, then close the connection
    flavor: str | None = "Google"  # response Metadata-Flavor (None: leave the header out)
    same_etag_at_once: bool = False  # long-polls answer at once with the unchanged value
    flapping_etag: bool = False  # every answer carries a new ETag, long-polls answer at once
    body: bytes | None = None  # serve this instead of the stored value
    no_length: bool = False  # no Content-Length: the body ends when the connection closes
    trickle_headers: float = 0.0  # seconds between bytes of the status line and headers (endless)
    trickle_body: float = 0.0  # headers at once, then the body a byte per this many seconds
    content_length: str | None = None  # send this Content-Length instead of the body's length
    short_by: int = 0  # declare this many bytes more than the body, send the body: a short body
    extra_headers: int = 0  # this many more header lines in each answer (X-Padding-N: x)
    long_header: int = 0  # one more header line of this many bytes
    status_line: bytes | None = None  # send this status line (CRLF added) instead of a real one


def etag_of(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class MetadataEmulator:
    """The emulator; use as a context manager, or start() and close() (stop() leaves it restartable)."""

    def __init__(
        self,
        attributes: Mapping[str, str] | None = None,
        *,
        project_attributes: Mapping[str, str] | None = None,
        instance: Mapping[str, str] | None = None,
        bind: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
        log_requests: bool = False,
    ) -> None:
        self.values: dict[str, str] = dict(NOTICE_DEFAULTS)
        for key, value in (instance or {}).items():
            self.values[f"instance/{key}"] = value
        for key, value in (attributes or {}).items():
            self.values[f"instance/attributes/{key}"] = value
        for key, value in (project_attributes or {}).items():
            self.values[f"project/attributes/{key}"] = value
        self.faults = Faults()
        self.bind = bind
        self.port = port
        self.log_requests = log_requests
        self._rng = random.Random(seed)
        self._changed = threading.Condition()
        self._version = 0
        self._flaps = 0
        self._fail_next = 0
        self._fail_status = 503
        self._pollers = 0
        self._stats_lock = threading.Lock()
        self._counted = threading.Condition(self._stats_lock)
        self.request_times: list[float] = []
        self.guest_attribute_writes = 0  # PUT and DELETE of guest attributes, answered or refused
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._writes_open = threading.Event()  # cleared: guest-attribute writes wait (hold_writes)
        self._writes_open.set()
        self._holder: socket.socket | None = None  # the port, bound but not listening, while stopped

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> MetadataEmulator:
        self._stopping.clear()
        self._server = _Server((self.bind, self.port), _Handler, self)  # beside the holder: both reuse
        self.port = self._server.server_address[1]
        self._release_port()
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="mds-emulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listening socket and every open connection: clients now get 'connection refused'.
        The port stays held until close(), so restart() gets it back."""
        self._stopping.set()
        self._writes_open.set()  # a held write ends unanswered (below)
        with self._changed:
            self._changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            family = self._server.address_family
            self._server.server_close()
            self._hold_port(family)
            self._server.drop_connections()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def restart(self) -> None:
        """Serve again on the same port (after stop)."""
        self.start()

    def close(self) -> None:
        """Stop, and give the port back."""
        self.stop()
        self._release_port()

    def _hold_port(self, family: socket.AddressFamily) -> None:
        """Keep the stopped emulator's port bound, not listening: a connect is still refused, but no
        bind(0) of another socket takes it (the kernel skips a port bound at all), which tests running
        at the same time in other processes would otherwise do, and answer in its place."""
        holder = socket.socket(family, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind((self.bind, self.port))
        except OSError:  # taken in the instant since the close: nothing left to hold
            holder.close()
            return
        self._holder = holder

    def _release_port(self) -> None:
        if self._holder is not None:
            self._holder.close()
            self._holder = None

    def __enter__(self) -> MetadataEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``, the form GCE_METADATA_HOST and metadata.host take."""
        return f"{self.bind}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}{ROOT}"

    # -- data ---------------------------------------------------------------------------------

    def set(self, path: str, value: str | None) -> None:
        """Set (None: delete) the value at ``path`` (``instance/attributes/tpu-env``); wakes long-polls."""
        with self._changed:
            if value is None:
                self.values.pop(path, None)
            else:
                self.values[path] = value
            self._version += 1
            self._changed.notify_all()

    def set_attribute(self, key: str, value: str | None) -> None:
        self.set(f"instance/attributes/{key}", value)

    def announce(
        self,
        *,
        maintenance: str | None = None,
        upcoming: Mapping[str, Any] | None = None,
        preempted: bool | None = None,
    ) -> None:
        """Change the notice keys as the server does before maintenance or a preemption (each a
        change of its own, waking its long-polls): ``maintenance`` the event (``NONE`` to end it),
        ``upcoming`` the scheduled window as a JSON object ({} removes it), ``preempted``."""
        if maintenance is not None:
            self.set("instance/maintenance-event", maintenance)
        if upcoming is not None:
            self.set(UPCOMING_MAINTENANCE, json.dumps(dict(upcoming)) if upcoming else None)
        if preempted is not None:
            self.set("instance/preempted", "TRUE" if preempted else "FALSE")

    def set_faults(self, **changes: Any) -> None:
        self.faults = replace(Faults(), **changes)

    def hold_writes(self) -> None:
        """Guest-attribute writes are counted, then wait unanswered until :meth:`release_writes`
        (or the stop): "never waits for a write" proved without a race against a delay."""
        self._writes_open.clear()

    def release_writes(self) -> None:
        self._writes_open.set()

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next ``count`` metadata requests with ``status``."""
        with self._stats_lock:
            self._fail_next = count
            self._fail_status = status

    def wait_for_pollers(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` long-polls are waiting for a change (True), or ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pollers >= count, timeout=timeout)

    def etag(self, path: str) -> str | None:
        with self._changed:
            value = self.values.get(path)
        return None if value is None else etag_of(value)

    def guest_attributes_enabled(self) -> bool:
        """``enable-guest-attributes`` on the instance, else on the project, read as Go's ParseBool."""
        with self._changed:
            value = self.values.get(f"instance/attributes/{ENABLE_GUEST_ATTRIBUTES}")
            if value is None:
                value = self.values.get(f"project/attributes/{ENABLE_GUEST_ATTRIBUTES}")
        return value is not None and value.strip() in ("1", "t", "T", "TRUE", "true", "True")

    def guest_attributes(self, namespace: str | None = None) -> dict[str, str]:
        """The guest attributes written (``ns/key``: value), whether or not reads are allowed now."""
        prefix = GUEST_ATTRIBUTES + (f"{namespace}/" if namespace else "")
        with self._changed:
            return {k[len(GUEST_ATTRIBUTES) :]: v for k, v in self.values.items() if k.startswith(prefix)}

    def _write_guest_attribute(self, path: str, value: str | None) -> tuple[int, str]:
        """(status, body) for a PUT (``value``) or DELETE (None) of ``instance/guest-attributes/...``."""
        if not self.guest_attributes_enabled():
            return 403, GUEST_ATTRIBUTES_DISABLED
        parts = path[len(GUEST_ATTRIBUTES) :].split("/")
        if len(parts) != 2 or not all(_GUEST_ATTRIBUTE_NAME.match(part) for part in parts):
            return 400, "Guest attributes are written as <namespace>/<key>.\n"
        self.set(path, value)
        return 200, ""

    # -- statistics ---------------------------------------------------------------------------

    @property
    def request_count(self) -> int:
        with self._stats_lock:
            return len(self.request_times)

    def peak_rate(self, window: float = 1.0) -> float:
        """The most requests seen in any ``window`` seconds, per second."""
        with self._stats_lock:
            times = sorted(self.request_times)
        best = start = 0
        for end, now in enumerate(times):
            while now - times[start] >= window:
                start += 1
            best = max(best, end - start + 1)
        return best / window

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` metadata requests have arrived in total (True), or ``timeout``."""
        with self._counted:
            return self._counted.wait_for(lambda: len(self.request_times) >= count, timeout=timeout)

    def _count(self) -> None:
        with self._counted:
            self.request_times.append(time.monotonic())
            self._counted.notify_all()

    # -- answering (called by the handler) -------------------------------------------------

    def _injected_status(self, faults: Faults) -> int | None:
        """The failure status to answer this request with, if any."""
        with self._stats_lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                return self._fail_status
            if faults.error_rate and self._rng.random() < faults.error_rate:
                return faults.error_status
        return None

    def _lookup(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str | None, str]:
        """(status, body, etag, content type) for a metadata path, waiting if it is a long-poll."""
        faults = self.faults
        path = _SLASHES.sub("/", path).lstrip("/")
        directory = path.endswith("/") or path == ""
        if query.get("wait_for_change", [""])[0] == "true":
            if directory:
                self._wait_for_directory_change(path, query, faults)
            else:
                self._wait_for_change(path, query, faults)
        with self._changed:
            if directory:
                return self._listing(path, query)
            value = self.values.get(path)
            if value is None:
                return 404, _NOT_FOUND, None, "text/html; charset=UTF-8"
            etag = etag_of(value)
            if faults.flapping_etag:
                self._flaps += 1
                etag = etag_of(f"{value}\0{self._flaps}")
            return 200, value, etag, "application/text"

    def _wait_for_change(self, path: str, query: dict[str, list[str]], faults: Faults) -> None:
        if faults.same_etag_at_once or faults.flapping_etag:
            return
        last = query.get("last_etag", [None])[0]
        try:
            timeout = float(query.get("timeout_sec", ["300"])[0])
        except ValueError:
            timeout = 300.0
        with self._changed:
            if path not in self.values:
                return  # the real server answers 404 at once
            version = self._version
            self._pollers += 1
            self._changed.notify_all()

            def changed() -> bool:
                if self._stopping.is_set():
                    return True
                if last is None:
                    return self._version != version
                value = self.values.get(path)
                return value is None or etag_of(value) != last

            try:
                self._changed.wait_for(changed, timeout=min(timeout, 3600.0))
            finally:
                self._pollers -= 1

    def _wait_for_directory_change(self, path: str, query: dict[str, list[str]], faults: Faults) -> None:
        """Wait until the directory's answer has another ETag than ``last_etag`` (or than now), as
        the real server does: a caller that is behind gets the current answer at once."""
        if faults.same_etag_at_once or faults.flapping_etag:
            return
        try:
            timeout = min(float(query.get("timeout_sec", ["300"])[0]), 3600.0)
        except ValueError:
            timeout = 300.0
        with self._changed:
            last = query.get("last_etag", [None])[0] or self._listing(path, query)[2]
            self._pollers += 1
            self._changed.notify_all()
            try:
                self._changed.wait_for(
                    lambda: self._stopping.is_set() or self._listing(path, query)[2] != last,
                    timeout=timeout,
                )
            finally:
                self._pollers -= 1

    def _listing(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str | None, str]:
        children = {key[len(path) :] for key in self.values if key.startswith(path)}
        if not children:
            return 404, _NOT_FOUND, None, "text/html; charset=UTF-8"
        if query.get("recursive", [""])[0] == "true":
            body = json.dumps(nested({child: self.values[path + child] for child in children}))
            return 200, body, etag_of(body), "application/json"
        names = sorted({child.split("/")[0] + ("/" if "/" in child else "") for child in children})
        body = "".join(name + "\n" for name in names)
        return 200, body, etag_of(body), "application/text"


_NOT_FOUND = "<!DOCTYPE html>\n<title>Error 404 (Not Found)</title>\n"
_SLASHES = re.compile("/+")


def nested(values: Mapping[str, str]) -> dict[str, Any]:
    """``{"attributes/k": v, "id": i}`` as the real server's recursive JSON: one object per directory."""
    tree: dict[str, Any] = {}
    for key, value in sorted(values.items()):
        node = tree
        *parents, leaf = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # a fleet connects at once; the default backlog of 5 drops SYNs

    def __init__(self, address: tuple[str, int], handler: type, emulator: MetadataEmulator) -> None:
        self.emulator = emulator
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that hang up (a watch being stopped, a fault test) are normal here."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def drop_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "Metadata Server for VM"
    sys_version = ""
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests read the counters, not a log

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.server.emulator.log_requests:  # a guest unit's journal: what a client asked, and the answer
            sys.stderr.write(f"{self.command} {self.path} -> {code}\n")
            sys.stderr.flush()

    def do_GET(self) -> None:
        split = urlsplit(self.path)
        if split.path.startswith(CONTROL):
            self._control_get(split.path)
            return
        emulator = self.server.emulator
        emulator._count()
        faults = emulator.faults
        if faults.delay and emulator._stopping.wait(faults.delay):
            return
        if self.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in self.headers:
            self._send(403, "Missing Metadata-Flavor:Google header.\n", None, "text/plain", faults)
            return
        if faults.status is not None:
            self._send(faults.status, f"status {faults.status}\n", None, "text/plain", faults)
            return
        injected = emulator._injected_status(faults)
        if injected is not None:
            self._send(injected, "injected failure\n", None, "text/plain", faults)
            return
        if not split.path.startswith(ROOT):
            above = {"/": "computeMetadata/\n", "/computeMetadata/": "v1/\n"}.get(split.path)
            if above is None:
                self._send(404, _NOT_FOUND, None, "text/html; charset=UTF-8", faults)
            else:  # google-auth's ping asks for "/"
                self._send(200, above, None, "application/text", faults)
            return
        path = split.path[len(ROOT) :]
        if path.startswith(GUEST_ATTRIBUTES[:-1]) and not emulator.guest_attributes_enabled():
            self._send(403, GUEST_ATTRIBUTES_DISABLED, None, "text/plain; charset=utf-8", faults)
            return
        status, body, etag, content_type = emulator._lookup(path, parse_qs(split.query))
        if faults.body is not None and status == 200:
            self._send_bytes(200, faults.body, etag, content_type, faults)
            return
        self._send(status, body, etag, content_type, faults)

    def _guest_attribute(self, value: str | None) -> None:
        """A PUT or DELETE of a guest attribute, checked as the server checks any request."""
        emulator = self.server.emulator
        emulator._count()
        with emulator._stats_lock:
            emulator.guest_attribute_writes += 1
        faults = emulator.faults
        path = urlsplit(self.path).path[len(ROOT) :]
        emulator._writes_open.wait()
        if emulator._stopping.is_set() or (faults.delay and emulator._stopping.wait(faults.delay)):
            return
        if self.headers.get("Metadata-Flavor") != "Google" or "X-Forwarded-For" in self.headers:
            self._send(403, "Missing Metadata-Flavor:Google header.\n", None, "text/plain", faults)
            return
        injected = faults.status if faults.status is not None else emulator._injected_status(faults)
        if injected is not None:
            self._send(injected, f"status {injected}\n", None, "text/plain", faults)
            return
        status, body = emulator._write_guest_attribute(path, value)
        self._send(status, body, None, "text/plain; charset=utf-8", faults)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def do_PUT(self) -> None:
        split = urlsplit(self.path)
        if split.path.startswith(ROOT + GUEST_ATTRIBUTES):
            self._guest_attribute(self._body().decode("utf-8", "replace"))
            return
        prefix = CONTROL + "v1/"
        if split.path == CONTROL + "faults":  # body: JSON object of Faults fields
            length = int(self.headers.get("Content-Length", "0"))
            self.server.emulator.set_faults(**json.loads(self.rfile.read(length) or b"{}"))
            self._send(200, "ok\n", None, "text/plain", Faults())
            return
        if not split.path.startswith(prefix):
            self._send(404, _NOT_FOUND, None, "text/plain", Faults())
            return
        length = int(self.headers.get("Content-Length", "0"))
        value = self.rfile.read(length).decode("utf-8")
        self.server.emulator.set(split.path[len(prefix) :], value)
        self._send(200, "ok\n", None, "text/plain", Faults())

    def do_DELETE(self) -> None:
        split = urlsplit(self.path)
        if split.path.startswith(ROOT + GUEST_ATTRIBUTES):
            self._guest_attribute(None)
            return
        prefix = CONTROL + "v1/"
        if split.path.startswith(prefix):
            self.server.emulator.set(split.path[len(prefix) :], None)
        self._send(200, "ok\n", None, "text/plain", Faults())

    def _control_get(self, path: str) -> None:
        emulator = self.server.emulator
        if path == CONTROL + "stats":
            stats = {
                "requests": emulator.request_count,
                "peak_rate": emulator.peak_rate(),
                "peak_rate_100ms": emulator.peak_rate(0.1),
                "guest_attribute_writes": emulator.guest_attribute_writes,
            }
            self._send(200, json.dumps(stats) + "\n", None, "application/json", Faults())
        else:
            self._send(404, _NOT_FOUND, None, "text/plain", Faults())

    def _send(self, status: int, body: str, etag: str | None, content_type: str, faults: Faults) -> None:
        self._send_bytes(status, body.encode("utf-8", "surrogatepass"), etag, content_type, faults)

    def _trickle(self, data: bytes, interval: float) -> bool:
        """Send ``data`` a byte every ``interval`` seconds; False once the emulator stops."""
        for byte in data:
            if self.server.emulator._stopping.wait(interval):
                return False
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
        return True

    def _send_bytes(
        self, status: int, body: bytes, etag: str | None, content_type: str, faults: Faults
    ) -> None:
        if faults.trickle_headers:
            # A status line, then a header line that never ends: the headers never complete.
            self.close_connection = True
            head = f"HTTP/1.1 {status} OK\r\nMetadata-Flavor: Google\r\nX-Slow: ".encode()
            if self._trickle(head, faults.trickle_headers):
                while self._trickle(b"a", faults.trickle_headers):
                    pass
            return
        if faults.status_line is not None:
            self.wfile.write(faults.status_line + b"\r\n")
        else:
            self.send_response(status)
        for n in range(faults.extra_headers):
            self.send_header(f"X-Padding-{n}", "x")
        if faults.long_header:
            self.send_header("X-Long", "a" * faults.long_header)
        if faults.flavor is not None:
            self.send_header("Metadata-Flavor", faults.flavor)
        self.send_header("Content-Type", content_type)
        if etag is not None:
            self.send_header("ETag", etag)
        if faults.no_length:
            self.send_header("Connection", "close")
            self.close_connection = True
        else:
            length = (
                faults.content_length
                if faults.content_length is not None
                else str(len(body) + faults.short_by)
            )
            self.send_header("Content-Length", length)
        self.end_headers()
        if faults.trickle_body:
            self.close_connection = True
            self.wfile.flush()
            self._trickle(body, faults.trickle_body)
            return
        if faults.drop and len(body) > 1:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)


def _load_values(path: str | None) -> dict[str, str]:
    if path is None:
        return {}
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping of name: value")
    return {str(k): v if isinstance(v, str) else tpu_env_yaml(v) for k, v in data.items()}


#: The signals that stop the script (a guest's systemd unit, a bench's terminate(), Ctrl-C).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def serve_until_signalled(emulator: MetadataEmulator, what: str) -> None:
    """Serve until SIGTERM or SIGINT, then stop. The signals are blocked before the server's
    threads start (they inherit the mask) and taken with ``sigwait``: no handler runs. A handler
    that set an Event deadlocked when the signal came while the main thread held that Event's
    lock, entering its wait, and the parent's ``communicate()`` then waited for ever."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    with emulator:
        print(f"{what} listening on {emulator.host}", flush=True)
        signal.sigwait(STOP_SIGNALS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GCE metadata server emulator (for tests)")
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--attributes", help="YAML mapping: instance attribute name -> value")
    parser.add_argument("--project-attributes", help="YAML mapping: project attribute name -> value")
    parser.add_argument("--instance", help="YAML mapping: instance path (like hostname) -> value")
    parser.add_argument("--error-rate", type=float, default=0.0, help="fraction of requests answered 503")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-requests", action="store_true", help="each request and its status on stderr")
    args = parser.parse_args(argv)
    emulator = MetadataEmulator(
        _load_values(args.attributes),
        project_attributes=_load_values(args.project_attributes),
        instance=_load_values(args.instance),
        bind=args.bind,
        port=args.port,
        seed=args.seed,
        log_requests=args.log_requests,
    )
    emulator.set_faults(error_rate=args.error_rate, delay=args.delay)
    serve_until_signalled(emulator, "metadata emulator")
    stats = {
        "requests": emulator.request_count,
        "peak_rate": emulator.peak_rate(),
        "guest_attribute_writes": emulator.guest_attribute_writes,
    }
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
