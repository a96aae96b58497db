"""The GCE metadata server client: every request tpuboot makes to the metadata server.

(tpuboot speaks HTTP in two other places: to dockerd on its unix socket,
:mod:`tpuboot.containers.dockerapi`, and as the server of its metrics, :mod:`tpuboot.metrics`.)

- Retries wait by :class:`tpuboot.backoff.Backoff`, full jitter above a 0.5 s floor, inside a
  deadline, so a fleet booting together does not hammer the server in lockstep and no host asks
  more than twice a second; a wait that would pass the deadline is shortened for a last try.
  404 is an answer (MetadataAbsent), not a failure, and is not retried. Each kind of failure of a
  URL is logged once (:mod:`tpuboot.gce.failures`), not once per try, by a client built with
  ``log_retries`` (the daemon's): a one-shot command's client leaves that out, since the one
  error it ends with names every kind, and a "retrying" line would outlive the command.
- Every request ends by a wall-clock deadline (:mod:`tpuboot.gce.transport`); a long-poll's own
  bound is ``timeout_sec`` plus ``timeout``.
- ``put`` (guest attributes, :mod:`tpuboot.gce.guestattrs`) takes the same path as ``get``: the
  same deadlines, flavor check and refusals; ``max_tries`` lets a writer that paces itself ask once.
- ``changes`` (:mod:`tpuboot.gce.watch`) is stopped by a threading.Event and ``close``, which
  shuts down the in-flight socket, so a 60 s long-poll does not delay shutdown.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

from tpuboot.backoff import Backoff
from tpuboot.errors import MetadataError
from tpuboot.eventloop import nothing
from tpuboot.gce.failures import FailureLog
from tpuboot.gce.keys import is_path
from tpuboot.gce.replies import Change, MetadataAbsent, MetadataRefused, MetadataUnanswered, Reply, Retryable
from tpuboot.gce.settings import (
    DEFAULT_MAX_BODY,
    DEFAULT_TIMEOUT,
    DEFAULT_URL,
    HOST_ENV,
    MIN_POLL_INTERVAL,
    MetadataSettings,
    metadata_base_url,
)
from tpuboot.gce.transport import Transport, exchange
from tpuboot.gce.watch import watch


def _tries(count: int) -> str:
    return "1 try" if count == 1 else f"{count} tries"


class MetadataClient:
    """Reads the metadata server; thread-safe. Build it with ``from_settings``."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_body: int = DEFAULT_MAX_BODY,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        min_poll_interval: float = MIN_POLL_INTERVAL,
        on_request: Callable[[str], None] | None = None,
        log_retries: bool = True,
    ) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.timeout = timeout
        self.max_body = max_body
        self.backoff = backoff or Backoff()
        self.min_poll_interval = min_poll_interval
        # Each request's outcome (ok, absent, refused, transient), e.g. tpuboot.metrics.metadata_request;
        # a seam, so `tpuboot metadata get` does not load prometheus_client to count into nothing.
        self.on_request = on_request or nothing
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._failures = FailureLog()
        self.log_retries = log_retries  # each kind of a get's failure logged once while it retries
        self._transport = Transport()
        self._watches: weakref.WeakSet[Transport] = weakref.WeakSet()
        self._closed = threading.Event()

    @classmethod
    def from_settings(
        cls,
        settings: MetadataSettings,
        environ: Mapping[str, str] | None = None,
        on_request: Callable[[str], None] | None = None,
        *,
        log_retries: bool = True,
    ) -> MetadataClient:
        """The client for ``settings``; ConfigError for a bad ``$GCE_METADATA_HOST`` or host.
        A one-shot command passes ``log_retries=False``: its error is its one line."""
        return cls(
            metadata_base_url(settings.host, environ),
            timeout=settings.timeout,
            max_body=settings.max_body,
            on_request=on_request,
            log_retries=log_retries,
        )

    def close(self) -> None:
        """Abort requests and watches in flight and refuse new ones (safe from any thread)."""
        self._closed.set()
        self._transport.close()
        for transport in list(self._watches):
            transport.abort()

    def url(self, path: str) -> str:
        """The full URL of ``path`` (relative, like ``instance/attributes/tpu-env``)."""
        if not is_path(path):
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
            except Retryable as failure:
                if method == "GET" and self.log_retries:  # a writer paces and reports its own failures
                    self._failures.failed(failure.kind, url, retrying=True)
                if failure.kind not in kinds:
                    kinds.append(failure.kind)
                attempt += 1
                delay = self._last_chance(self._delay(attempt - 1), deadline)
                if delay is None or attempt == max_tries:
                    raise MetadataUnanswered(
                        self.base_url,
                        f"{', then '.join(kinds)} ({_tries(attempt)} in {deadline_s:g} s)",
                        f"check the VM's network, or metadata.host / ${HOST_ENV}",
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
        except Retryable as failure:
            raise MetadataError(
                f"metadata server {self.base_url}: {failure.kind}; check the VM's network, or metadata.host"
            ) from None

    def changes(
        self,
        path: str,
        *,
        stop: threading.Event,
        etag: str | None = None,
        timeout_sec: int = 60,
        absent_interval: float = 0.0,
        absent_wait: Callable[[float], bool] | None = None,
    ) -> Iterator[Change]:
        """Yield each change of ``path`` until ``stop`` is set (:func:`tpuboot.gce.watch.watch`).

        ``stop`` ends the watch at its next wake-up; set it and call ``close()`` to end a
        long-poll in flight at once (nothing polls ``stop``: an idle watch never wakes).
        With ``etag`` None the current value is yielded first. Failures are logged once
        per kind and retried with backoff forever; a vanished key yields ``Change(None,
        None)`` once, then is polled for with backoff, at most once every ``absent_interval`` s
        (or at ``absent_wait``'s pace).
        """
        url = self.url(path)
        transport = Transport()
        self._watches.add(transport)
        if self._closed.is_set():
            transport.abort()
        timeout_sec = max(1, timeout_sec)

        def poll(etag: str | None) -> Reply:
            return self._poll(transport, url, etag, timeout_sec)

        try:
            yield from watch(
                poll,
                url,
                stop=stop,
                etag=etag,
                timeout_sec=timeout_sec,
                failures=self._failures,
                delay=self._delay,
                min_poll_interval=self.min_poll_interval,
                aborted=lambda: transport.aborted,
                absent_interval=absent_interval,
                absent_wait=absent_wait,
            )
        finally:
            transport.close()

    def _poll(self, transport: Transport, url: str, etag: str | None, timeout_sec: int) -> Reply:
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
        transport: Transport,
        url: str,
        params: dict[str, str],
        timeouts: tuple[float, float],
        deadline: float,
        method: str = "GET",
        data: bytes | None = None,
    ) -> Reply:
        """One request (:func:`tpuboot.gce.transport.exchange`), counted by ``on_request``."""
        return exchange(
            transport,
            url,
            params=params,
            timeouts=timeouts,
            deadline=deadline,
            max_body=self.max_body,
            on_request=self.on_request,
            method=method,
            data=data,
        )
