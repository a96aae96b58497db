"""The change watch of one metadata key: a long-poll that costs nothing while nothing changes.

Long-poll with ``wait_for_change``/``last_etag``/``timeout_sec`` and a read timeout a little above
``timeout_sec`` (:meth:`tpuboot.gce.client.MetadataClient.changes` makes the polls). Answers faster
than half the poll time (errors, the same ETag at once, a flapping ETag) back off exponentially
and never come more than once every ``min_poll_interval``. A change is a change of the value: a
new ETag over the same body (a flapping server) is not yielded, so it costs its consumer no
rewrite and no log line. Nothing polls ``stop``: the caller cuts a poll in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from tpuboot.gce.failures import FailureLog
from tpuboot.gce.replies import Change, MetadataAbsent, MetadataRefused, Reply, Retryable


def watch(
    poll: Callable[[str | None], Reply],
    url: str,
    *,
    stop: threading.Event,
    etag: str | None,
    timeout_sec: int,
    failures: FailureLog,
    delay: Callable[[int], float],
    min_poll_interval: float,
    aborted: Callable[[], bool],
    absent_interval: float = 0.0,
    absent_wait: Callable[[float], bool] | None = None,
) -> Iterator[Change]:
    """Yield each change of the value ``poll(etag)`` returns until ``stop`` is set or ``aborted()``.

    ``poll`` long-polls with an ETag and reads plainly without one, raising Retryable,
    MetadataAbsent or MetadataRefused; ``delay(n)`` is the backoff after n quick answers in a row.
    A vanished key yields ``Change(None, None)`` once, then is polled for with backoff, and at
    most once every ``absent_interval`` seconds (a missing key has no ETag to long-poll with).
    ``absent_wait(at_least)``, if given, is that wait (True: stopped): the caller's clock then
    paces those reads, as the notices' tick does (tpuboot/notices/watch.py).
    """
    attempt = 0
    absent = False
    last_body: bytes | None = None
    while not stop.is_set():
        started = time.monotonic()
        change: Change | None = None
        try:
            reply = poll(etag)
        except Retryable as failure:
            if stop.is_set() or aborted():
                return
            failures.failed(failure.kind, url, retrying=True)
        except MetadataRefused as refused:
            failures.failed(str(refused), url, retrying=True)
        except MetadataAbsent:
            failures.recovered(url)
            if not absent:
                change = Change(None, None)
            absent, etag, last_body = True, None, None
        else:
            failures.recovered(url)
            moved = reply.etag is None or reply.etag != etag
            if absent or (moved and reply.body != last_body):  # a new ETag alone is no change
                change = Change(reply.body, reply.etag)
            absent, etag, last_body = False, reply.etag, reply.body
        if change is not None and not stop.is_set():
            yield change
        elapsed = time.monotonic() - started
        if elapsed >= timeout_sec / 2:  # a real long-poll: the server behaves
            attempt = 0
            continue
        wait = max(min_poll_interval - elapsed, delay(attempt))
        attempt += 1
        if absent:
            wait = max(wait, absent_interval - elapsed)
            if absent_wait is not None:
                if absent_wait(wait):
                    return
                continue
        if stop.wait(wait):
            return
