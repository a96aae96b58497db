"""The watch of one notice key: the metadata client's long-poll (tpuboot/gce/watch.py: ETags,
backoff, quiet on flaps, one connection), restarted after a bug like the tpu-env watch.

One thread per key, each with the one connection its ``changes`` holds: the three keys change
apart, and the server's ``wait_for_change`` watches one path (a directory long-poll of
``instance/`` would wake for every change of the instance's data, and its recursive answer
carries the service-account paths too). Idle, each thread sleeps in its long-poll: no wake-up
until the server answers (``timeout_sec``, 60 s) or a value changes. A key that is absent
(``upcoming-maintenance`` while nothing is scheduled) is read every :data:`ABSENT_INTERVAL` s.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from tpuboot.backoff import RestartPolicy
from tpuboot.gce.client import MetadataClient
from tpuboot.notices.parse import KEYS, NoticeKind

log = logging.getLogger("tpuboot.notices.watch")

#: Seconds between two reads of a key while it is absent (``upcoming-maintenance`` until a window
#: is scheduled, hours or days ahead): a missing key has no ETag to long-poll with.
ABSENT_INTERVAL = 30.0
#: The wait after an unexpected exception: first, doubling up to the maximum (as tpu-env's watch).
RETRY_FIRST = 1.0
RETRY_MAX = 300.0


def watch_key(
    client: MetadataClient,
    kind: NoticeKind,
    stop: threading.Event,
    on_change: Callable[[NoticeKind, bytes | None], None],
    *,
    timeout_sec: int = 60,
    absent_interval: float = ABSENT_INTERVAL,
) -> None:
    """Call ``on_change(kind, body)`` with the key's value now, then at each change (None: the key
    is absent), until ``stop`` is set and the client closed. Never raises: a bug is logged once a
    streak and the watch starts again after a backoff."""
    backoff = RestartPolicy(RETRY_FIRST, RETRY_MAX, stable_after=math.inf)
    while not stop.is_set():
        try:
            changes = client.changes(
                KEYS[kind], stop=stop, timeout_sec=timeout_sec, absent_interval=absent_interval
            )
            for change in changes:
                on_change(kind, change.value)
                backoff.reset()
            return  # the changes end only when stop is set or the client is closed
        except Exception:
            if stop.is_set():
                return
            delay = backoff.delay_after(0.0)
            if backoff.exits == 1:
                log.exception(
                    "notices: the %s watch failed; retrying in %g s (please report it)", kind, delay
                )
            if stop.wait(delay):
                return
