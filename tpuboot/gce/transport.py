"""The sockets under the metadata client, and one try over them.

- Proxies from the environment are ignored (``trust_env=False``): a proxy cannot reach the
  link-local server. Redirects are not followed. urllib3 does not retry: the client does.
- Every try ends by a wall-clock deadline, not only each receive by a timeout: a server that
  trickles its headers or body a byte at a time cannot hold a try past it
  (:class:`tpuboot.netio.DeadlineSocket` re-arms each receive to what is left).
- Another thread can cut every socket of a :class:`Transport` (``abort``): a long-poll in flight
  then ends at once instead of after its ``timeout_sec``, so shutdown is not delayed.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import requests
import urllib3
import urllib3.connection
from requests.adapters import HTTPAdapter

from tpuboot.gce.framing import REQUEST_HEADERS, check_answer, failure_kind, read_body
from tpuboot.gce.replies import MetadataAbsent, MetadataRefused, Reply, Retryable
from tpuboot.netio import DeadlineSocket


class Transport:
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
    """Hands every new connection's socket to its Transport."""

    def __init__(self, transport: Transport, **kwargs: Any) -> None:
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


def exchange(
    transport: Transport,
    url: str,
    *,
    params: dict[str, str],
    timeouts: tuple[float, float],
    deadline: float,
    max_body: int,
    on_request: Callable[[str], None],
    method: str = "GET",
    data: bytes | None = None,
) -> Reply:
    """One request, over by ``deadline`` (monotonic); raises Retryable, MetadataAbsent or -Refused.

    ``on_request`` hears the outcome: ok, absent, refused or transient.
    """
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
            check_answer(response, deadline)
            reply = Reply(read_body(response, deadline, max_body), response.headers.get("ETag"))
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        on_request("transient")
        raise Retryable(failure_kind(exc)) from None
    except (ValueError, http.client.HTTPException) as exc:
        # What the HTTP stack raises past its own exception types on a malformed answer: a
        # negative chunk size reaches read() as ValueError (urllib3 trusts int(size, 16)).
        on_request("transient")
        raise Retryable(f"malformed answer ({type(exc).__name__}: {str(exc)[:80]})") from None
    except Retryable:
        on_request("transient")
        raise
    except MetadataAbsent:
        on_request("absent")
        raise
    except MetadataRefused:
        on_request("refused")
        raise
    on_request("ok")
    return reply
