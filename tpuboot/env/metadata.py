"""The GCE metadata server client: every request tpuboot makes to the metadata server.

(tpuboot speaks HTTP in two other places: to dockerd on its unix socket,
:mod:`tpuboot.containers.dockerapi`, and as the server of its metrics, :mod:`tpuboot.metrics`.)

Why each choice:
- Address ``169.254.169.254``, not ``metadata.google.internal``: DNS may not work yet at boot.
  ``GCE_METADATA_HOST`` (host[:port]; the older name ``GCE_METADATA_ROOT`` too) overrides it as
  in google-auth and google-cloud-go, and **wins over** the config key ``metadata.host``: the
  environment is the per-run override (tests, one-off commands), the file the standing default.
- Proxies from the environment are ignored (``trust_env=False``): a proxy cannot reach the
  link-local server. Redirects are not followed. Request and response both carry
  ``Metadata-Flavor: Google``; a response without it is not from the metadata server.
- The body is streamed and capped (``metadata.max_body``); a short body is detected even
  where urllib3 1.26 would not check Content-Length.
- Retries use exponential backoff with full jitter above a 0.5 s floor inside a deadline,
  so a fleet booting together does not hammer the server in lockstep and no host asks more
  than twice a second; a wait that would pass the deadline is shortened for a last try.
  404 is an answer ("absent"), not a failure, and is not retried. Each kind of failure is
  logged once until it changes or the server recovers (as compute-image-packages'
  metadata_watcher does), not once per try.
- Every request ends by a wall-clock deadline, not only each receive by a timeout: a server
  that trickles its headers or body a byte at a time cannot hold a try past ``timeout``
  seconds nor ``get`` past its deadline (:class:`tpuboot.netio.DeadlineSocket` re-arms each
  receive to what is left). A long-poll's own bound is ``timeout_sec`` plus ``timeout``.
- ``put`` (guest attributes, tpuboot/guestattrs.py) takes the same path as ``get``: the same
  deadlines, flavor check and refusals; ``max_tries`` lets a writer that paces itself ask once.
- Change watch: long-poll with ``wait_for_change``/``last_etag``/``timeout_sec`` and a read
  timeout a little above ``timeout_sec``. Answers faster than half the poll time (errors,
  the same ETag at once, a flapping ETag) back off exponentially and never come more than
  once a second. ``changes`` is stopped by a threading.Event: a guard thread shuts down the
  in-flight socket within half a second, so a 60 s long-poll does not delay shutdown.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import random
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import requests
import urllib3
import urllib3.connection
from requests.adapters import HTTPAdapter

from tpuboot.config import MetadataConfig
from tpuboot.errors import ConfigError, MetadataError, UsageError
from tpuboot.netio import DeadlineSocket, ascii_int

log = logging.getLogger("tpuboot.env.metadata")

DEFAULT_HOST = "169.254.169.254"
HOST_ENV = "GCE_METADATA_HOST"
LEGACY_HOST_ENV = "GCE_METADATA_ROOT"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
REQUEST_HEADERS = {FLAVOR_HEADER: FLAVOR, "Accept-Encoding": "identity"}

#: Where the instance's and the project's custom metadata (attributes) are.
INSTANCE_ATTRIBUTES = "instance/attributes/"
PROJECT_ATTRIBUTES = "project/attributes/"

#: Where ``tpuboot metadata get --type KIND KEY`` looks.
KINDS = {
    "attributes": INSTANCE_ATTRIBUTES,
    "project-attributes": PROJECT_ATTRIBUTES,
    "instance": "instance/",
}

#: A watch never asks more often than this (seconds), whatever the server answers.
MIN_POLL_INTERVAL = 1.0

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?\Z")
_SEGMENT = r"[A-Za-z0-9_.-]+"
_PATH = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*/?\Z")


class MetadataAbsent(MetadataError):
    """The server says the key does not exist (HTTP 404)."""

    transient = False


class MetadataRefused(MetadataError):
    """The server answered something retrying will not fix (redirect, 4xx, oversized body).

    ``status`` is the HTTP status when the server refused (403 for guest attributes disabled).
    """

    transient = False

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Retryable(Exception):
    """One try failed in a way another try may not (connection, 5xx, timeout, no flavor)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass(frozen=True)
class Reply:
    """A 200 answer: the raw body and the ETag the server gave (None if it gave none)."""

    body: bytes
    etag: str | None

    @property
    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError:
            raise MetadataRefused("the metadata value is not UTF-8 text; fix the attribute") from None


@dataclass(frozen=True)
class Change:
    """What a watch saw: a new value and its ETag, or ``value`` None when the key vanished."""

    value: bytes | None
    etag: str | None


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff, full jitter above a floor: wait n is floor + U(0, min(maximum, initial * 2**n)).

    The jitter spreads a fleet's retries; the floor caps one host at 1/floor requests a
    second (2/s) whatever the jitter draws; the maximum bounds the wait once the server is back.
    """

    initial: float = 1.0
    maximum: float = 4.0
    floor: float = 0.5

    def delay(self, attempt: int, rng: random.Random) -> float:
        return self.floor + rng.uniform(0.0, min(self.maximum, self.initial * 2.0 ** min(attempt, 32)))


def metadata_base_url(config_host: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The server's base URL: ``$GCE_METADATA_HOST`` over config ``metadata.host`` over 169.254.169.254."""
    env = os.environ if environ is None else environ
    from_env = env.get(HOST_ENV) or env.get(LEGACY_HOST_ENV)
    host = from_env or config_host or DEFAULT_HOST
    if not _HOST.match(host):
        where = f"${HOST_ENV}" if from_env else "metadata.host"
        raise ConfigError(
            f"{where}: {host!r} is not host[:port]; write it like 169.254.169.254 or 127.0.0.1:8080"
        )
    return f"http://{host}/computeMetadata/v1/"


class _FailureLog:
    """Logs each kind of failure once until the server answers again, then the recovery once.

    A flapping server (dropped, timed out, dropped, ...) costs one line per kind, not per try.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds: list[str] = []

    def failed(self, kind: str, url: str, retrying: bool) -> None:
        with self._lock:
            if kind in self._kinds:
                return
            self._kinds.append(kind)
        then = "retrying with backoff" if retrying else "not retrying"
        log.warning(
            "metadata server %s: %s; %s (logged once until it answers again)",
            url,
            kind,
            then,
            extra={"METADATA_URL": url, "METADATA_FAILURE": kind},
        )

    def recovered(self, url: str) -> None:
        with self._lock:
            kinds, self._kinds = self._kinds, []
        if kinds:
            was = ", ".join(kinds)
            log.info("metadata server %s: answering again (was: %s)", url, was, extra={"METADATA_URL": url})


class _Transport:
    """A requests Session without proxies or retries whose sockets another thread can cut.

    ``abort`` shuts down every socket the session opened (and any it opens afterwards): a
    request blocked in a long-poll then fails at once instead of after ``timeout_sec``.
    ``bounded(deadline)`` makes every receive and send of this thread's request end by it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self.aborted = False
        self.session = requests.Session()
        self.session.trust_env = False  # no *_PROXY, no .netrc
        adapter = _TrackingAdapter(self, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def deadline(self) -> float | None:
        """The monotonic deadline of the request this thread is making (None outside one)."""
        return getattr(self._local, "deadline", None)

    @contextlib.contextmanager
    def bounded(self, deadline: float) -> Iterator[None]:
        saved = self.deadline()
        self._local.deadline = deadline
        try:
            yield
        finally:
            self._local.deadline = saved

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
            if self.aborted:
                _shutdown(sock)

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            for sock in list(self._sockets):
                _shutdown(sock)

    def close(self) -> None:
        self.abort()
        self.session.close()


def _shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock``; the owner still closes it (no fd-reuse race)."""
    with contextlib.suppress(OSError):  # already closed or never connected
        sock.shutdown(socket.SHUT_RDWR)


class _TrackingAdapter(HTTPAdapter):
    """Hands every new connection's socket to its _Transport."""

    def __init__(self, transport: _Transport, **kwargs: Any) -> None:
        self._transport = transport  # before super().__init__, which builds the pool manager
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        transport = self._transport

        class Connection(urllib3.connection.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                self.sock = DeadlineSocket.adopt(self.sock, transport.deadline)
                transport.track(self.sock)

        class Pool(urllib3.HTTPConnectionPool):
            ConnectionCls = Connection

        self.poolmanager.pool_classes_by_scheme = {**self.poolmanager.pool_classes_by_scheme, "http": Pool}


def _tries(count: int) -> str:
    return "1 try" if count == 1 else f"{count} tries"


def _failure_kind(exc: BaseException) -> str:
    """A short, stable name for why a try failed (the unit of 'log once per kind')."""
    text = str(exc)
    if isinstance(exc, requests.Timeout) or "timed out" in text:
        return "timed out"
    if "Connection refused" in text:
        return "connection refused"
    if "unreachable" in text or "No route to host" in text:
        return "network unreachable"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError) or any(
        word in text
        for word in ("IncompleteRead", "RemoteDisconnected", "aborted", "reset by peer", "Broken pipe")
    ):
        return "connection dropped"
    return f"request failed ({type(exc).__name__})"


def _ignore(outcome: str) -> None:
    """The default ``on_request``: count nothing."""


class MetadataClient:
    """Reads the metadata server; thread-safe. Build it with ``from_config``."""

    def __init__(
        self,
        base_url: str = f"http://{DEFAULT_HOST}/computeMetadata/v1/",
        *,
        timeout: float = 5.0,
        max_body: int = 1 << 20,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        min_poll_interval: float = MIN_POLL_INTERVAL,
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.timeout = timeout
        self.max_body = max_body
        self.backoff = backoff or Backoff()
        self.min_poll_interval = min_poll_interval
        # Each request's outcome (ok, absent, refused, transient), e.g. tpuboot.metrics.metadata_request;
        # a seam, so `tpuboot metadata get` does not load prometheus_client to count into nothing.
        self.on_request = on_request or _ignore
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._failures = _FailureLog()
        self._transport = _Transport()
        self._watches: weakref.WeakSet[_Transport] = weakref.WeakSet()
        self._closed = threading.Event()

    @classmethod
    def from_config(
        cls,
        config: MetadataConfig,
        environ: Mapping[str, str] | None = None,
        on_request: Callable[[str], None] | None = None,
    ) -> MetadataClient:
        return cls(
            metadata_base_url(config.host, environ),
            timeout=config.timeout,
            max_body=config.max_body,
            on_request=on_request,
        )

    def close(self) -> None:
        """Abort requests and watches in flight and refuse new ones (safe from any thread)."""
        self._closed.set()
        self._transport.close()
        for transport in list(self._watches):
            transport.abort()

    def url(self, path: str) -> str:
        """The full URL of ``path`` (relative, like ``instance/attributes/tpu-env``)."""
        if not _PATH.match(path) or any(part in (".", "..") for part in path.split("/")):
            raise ValueError(f"not a metadata path: {path!r}")
        return self.base_url + path

    def get(self, path: str, *, deadline_s: float) -> Reply:
        """The value at ``path``, retrying within ``deadline_s`` seconds.

        Raises MetadataAbsent (404), MetadataRefused (an answer retrying cannot fix), or
        MetadataError (no usable answer before the deadline).
        """
        return self._request("GET", path, None, deadline_s, max_tries=0)

    def put(self, path: str, value: str, *, deadline_s: float, max_tries: int = 0) -> None:
        """Write ``value`` at ``path`` (guest attributes: ``instance/guest-attributes/NS/KEY``).

        The same deadline, checks and backoff as ``get``; ``max_tries`` (0: no limit but the
        deadline) lets a caller that paces its own writes, as the server's quota asks, try once.
        Raises as ``get`` does; a refusal's MetadataRefused carries the HTTP status.
        """
        self._request("PUT", path, value.encode("utf-8"), deadline_s, max_tries=max_tries)

    def _request(
        self, method: str, path: str, data: bytes | None, deadline_s: float, *, max_tries: int
    ) -> Reply:
        url = self.url(path)
        deadline = time.monotonic() + deadline_s
        attempt = 0
        kinds: list[str] = []  # every kind of failure seen, in order: the last try alone can mislead
        while True:
            if self._closed.is_set():
                raise MetadataError(f"metadata request for {path} cancelled: tpuboot is stopping")
            now = time.monotonic()
            limit = min(self.timeout, max(0.05, deadline - now))
            try:
                reply = self._try(self._transport, url, {}, (limit, limit), now + limit, method, data)
            except _Retryable as failure:
                if method == "GET":  # a writer paces and reports its own failures
                    self._failures.failed(failure.kind, url, retrying=True)
                if failure.kind not in kinds:
                    kinds.append(failure.kind)
                attempt += 1
                delay = self._last_chance(self._delay(attempt - 1), deadline)
                if delay is None or attempt == max_tries:
                    raise MetadataError(
                        f"metadata server {self.base_url}: {', then '.join(kinds)} ({_tries(attempt)} in "
                        f"{deadline_s:g} s); check the VM's network, or metadata.host / ${HOST_ENV}"
                    ) from None
                self._closed.wait(delay)
                continue
            except MetadataRefused as refused:
                # the caller logs it
                raise MetadataRefused(f"metadata server {url}: {refused}", refused.status) from None
            except MetadataAbsent:
                self._failures.recovered(url)
                raise
            self._failures.recovered(url)
            return reply

    def wait_for_change(self, path: str, *, etag: str | None, timeout_sec: int) -> Reply:
        """One long-poll, no retry: returns when the ETag differs from ``etag`` or after ``timeout_sec``.

        Raises MetadataError (with MetadataAbsent and MetadataRefused as for ``get``) when the
        poll fails, at the latest ``timeout_sec`` + ``timeout`` seconds after it began.
        """
        try:
            return self._poll(self._transport, self.url(path), etag, timeout_sec)
        except _Retryable as failure:
            raise MetadataError(
                f"metadata server {self.base_url}: {failure.kind}; check the VM's network, or metadata.host"
            ) from None

    def changes(
        self, path: str, *, stop: threading.Event, etag: str | None = None, timeout_sec: int = 60
    ) -> Iterator[Change]:
        """Yield each change of ``path`` until ``stop`` is set.

        ``stop`` ends the watch at its next wake-up; set it and call ``close()`` to end a
        long-poll in flight at once (nothing polls ``stop``: an idle watch never wakes).
        With ``etag`` None the current value is yielded first. Failures are logged once
        per kind and retried with backoff forever; a vanished key yields ``Change(None,
        None)`` once, then is polled for with backoff.
        """
        url = self.url(path)
        transport = _Transport()
        self._watches.add(transport)
        if self._closed.is_set():
            transport.abort()
        try:
            yield from self._watch(transport, url, stop, etag, max(1, timeout_sec))
        finally:
            transport.close()

    def _watch(
        self, transport: _Transport, url: str, stop: threading.Event, etag: str | None, timeout_sec: int
    ) -> Iterator[Change]:
        attempt = 0
        absent = False
        last_body: bytes | None = None
        while not stop.is_set():
            started = time.monotonic()
            change: Change | None = None
            try:
                reply = self._poll(transport, url, etag, timeout_sec)
            except _Retryable as failure:
                if stop.is_set() or transport.aborted:
                    return
                self._failures.failed(failure.kind, url, retrying=True)
            except MetadataRefused as refused:
                self._failures.failed(str(refused), url, retrying=True)
            except MetadataAbsent:
                self._failures.recovered(url)
                if not absent:
                    change = Change(None, None)
                absent, etag, last_body = True, None, None
            else:
                self._failures.recovered(url)
                if reply.etag != etag or (reply.etag is None and reply.body != last_body):
                    change = Change(reply.body, reply.etag)
                absent, etag, last_body = False, reply.etag, reply.body
            if change is not None and not stop.is_set():
                yield change
            elapsed = time.monotonic() - started
            if elapsed >= timeout_sec / 2:  # a real long-poll: the server behaves
                attempt = 0
                continue
            wait = max(self.min_poll_interval - elapsed, self._delay(attempt))
            attempt += 1
            if stop.wait(wait):
                return

    def _poll(self, transport: _Transport, url: str, etag: str | None, timeout_sec: int) -> Reply:
        """A long-poll if we know an ETag, else a plain read (to learn the value and its ETag)."""
        if etag is None:
            params: dict[str, str] = {}
            timeouts = (min(self.timeout, 1.0), self.timeout)
        else:
            params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(timeout_sec)}
            timeouts = (min(self.timeout, 1.0), timeout_sec + self.timeout)
        # The whole poll, headers and body, ends by the server's hang time plus one timeout.
        return self._try(transport, url, params, timeouts, time.monotonic() + timeouts[1])

    def _last_chance(self, delay: float, deadline: float) -> float | None:
        """``delay``, shortened to 80% of the time left so a recovery just before the deadline is seen.

        None when even the floor no longer fits: the caller gives up instead of retrying faster.
        """
        remaining = deadline - time.monotonic()
        delay = min(delay, 0.8 * remaining)
        return delay if delay >= max(self.backoff.floor, 0.01) else None

    def _delay(self, attempt: int) -> float:
        with self._rng_lock:
            return self.backoff.delay(attempt, self._rng)

    def _try(
        self,
        transport: _Transport,
        url: str,
        params: dict[str, str],
        timeouts: tuple[float, float],
        deadline: float,
        method: str = "GET",
        data: bytes | None = None,
    ) -> Reply:
        """One request, over by ``deadline`` (monotonic); raises _Retryable, MetadataAbsent or -Refused."""
        try:
            with (
                transport.bounded(deadline),
                transport.session.request(
                    method,
                    url,
                    params=params,
                    data=data,
                    headers=REQUEST_HEADERS,
                    timeout=timeouts,
                    stream=True,
                    allow_redirects=False,
                ) as response,
            ):
                self._check_answer(response, deadline)
                reply = Reply(self._read_body(response, deadline), response.headers.get("ETag"))
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            self.on_request("transient")
            raise _Retryable(_failure_kind(exc)) from None
        except (ValueError, http.client.HTTPException) as exc:
            # What the HTTP stack raises past its own exception types on a malformed answer: a
            # negative chunk size reaches read() as ValueError (urllib3 trusts int(size, 16)).
            self.on_request("transient")
            raise _Retryable(f"malformed answer ({type(exc).__name__}: {str(exc)[:80]})") from None
        except _Retryable:
            self.on_request("transient")
            raise
        except MetadataAbsent:
            self.on_request("absent")
            raise
        except MetadataRefused:
            self.on_request("refused")
            raise
        self.on_request("ok")
        return reply

    def _check_answer(self, response: requests.Response, deadline: float) -> None:
        flavor = response.headers.get(FLAVOR_HEADER)
        if flavor != FLAVOR:
            raise _Retryable(
                f"answer without the {FLAVOR_HEADER}: {FLAVOR} header (not the metadata server?)"
                if flavor is None
                else f"answer with {FLAVOR_HEADER}: {flavor[:40]!r} (not the metadata server?)"
            )
        status = response.status_code
        if status == 404:
            raise MetadataAbsent(f"{response.url.split('?')[0]}: no such metadata key")
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}")
        if status != 200:
            said = self._reason(response, deadline)
            raise MetadataRefused(f"answered HTTP {status}{said}; check the key and the request", status)

    @staticmethod
    def _reason(response: requests.Response, deadline: float) -> str:
        """The first line of a refusal's body, printable and short (the real server says why there:
        "Guest attributes endpoint access is disabled."); empty if there is none to read in time."""
        head = b""
        try:
            for chunk in response.iter_content(256):
                head += chunk
                if len(head) >= 256 or time.monotonic() > deadline:
                    break
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError,
                http.client.HTTPException):  # fmt: skip
            pass  # a malformed body cannot turn the refusal into a retried failure
        line = head[:256].decode("utf-8", "replace").strip().splitlines()[:1]
        text = "".join(c if c.isprintable() else "?" for c in (line[0] if line else ""))[:120]
        return f" ({text})" if text else ""

    def _read_body(self, response: requests.Response, deadline: float) -> bytes:
        header = response.headers.get("Content-Length")
        declared = ascii_int(header)
        if header is not None and declared is None:
            raise _Retryable(
                f"answer with Content-Length {header[:40]!r}, not a number (not the metadata server?)"
            )
        if declared is not None and declared > self.max_body:
            raise MetadataRefused(self._too_big())
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_content(1 << 16):
            size += len(chunk)
            if size > self.max_body:
                raise MetadataRefused(self._too_big())
            if time.monotonic() > deadline:  # the socket ends each receive by it; this ends the loop
                raise _Retryable("timed out")
            chunks.append(chunk)
        body = b"".join(chunks)
        encoded = response.headers.get("Content-Encoding", "identity") != "identity"
        if declared is not None and not encoded and len(body) != declared:
            raise _Retryable("connection dropped")
        return body

    def _too_big(self) -> str:
        return f"metadata value over {self.max_body} bytes; raise metadata.max_body or shrink the value"


def metadata_get(client: MetadataClient, kind: str, key: str, *, deadline_s: float = 15.0) -> str:
    """The text of one metadata key, for ``tpuboot metadata get``; MetadataAbsent if it does not exist."""
    if kind not in KINDS:
        raise UsageError(f"unknown metadata type {kind!r}; use one of {', '.join(KINDS)}")
    path = KINDS[kind] + key
    if not key or not _PATH.match(path) or any(part in (".", "..") for part in key.split("/")):
        raise UsageError(
            f"{key!r} is not a metadata key; use letters, digits, '-', '_', '.' (and '/' for instance)"
        )
    if kind != "instance" and "/" in key:
        raise UsageError(f"{key!r}: attribute names have no '/'; use --type instance for paths")
    return client.get(path, deadline_s=deadline_s).text
