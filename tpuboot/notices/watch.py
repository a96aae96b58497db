"""The watch of one notice key: the metadata client's long-poll (tpuboot/gce/watch.py: ETags,
backoff, quiet on flaps, one connection), restarted after a bug like the tpu-env watch.

One thread per key, each with the one connection its ``changes`` holds: the three keys change
apart, and the server's ``wait_for_change`` watches one path (a directory long-poll of
``instance/`` would wake for every change of the instance's data, and its recursive answer
carries the service-account paths too). Idle, each thread sleeps in its long-poll: no wake-up
until the server answers (``timeout_sec``, 60 s) or a value changes. A key that is absent
(``upcoming-maintenance`` while nothing is scheduled) is read again at the daemon's tick
(:class:`TickPace`), at most once every :data:`ABSENT_INTERVAL` s: the read rides on the wake-up
the watchdog's tick makes anyway, so an idle daemon wakes for that tick and the server's answers only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tpuboot.backoff import restarted
from tpuboot.gce.client import MetadataClient
from tpuboot.notices.parse import KEYS, NoticeKind

log = logging.getLogger("tpuboot.notices.watch")

#: Seconds between two reads of a key while it is absent (``upcoming-maintenance`` until a window
#: is scheduled, hours or days ahead): a missing key has no ETag to long-poll with.
ABSENT_INTERVAL = 30.0
#: Seconds by which a tick may come early and still be the one an absent key waits for (a tick
#: every 30 s and reads every 30 s would otherwise miss by a hair, and wait for the next).
PACE_SLACK = 1.0


class TickPace:
    """The daemon's tick as the clock of the absent keys' reads: ``tick()`` is called from the
    notices' tick (in the daemon's pool), and a watch waiting in :meth:`wait` sleeps until then,
    with no timer of its own."""

    def __init__(self, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self._stop = stop
        self._clock = clock
        self._ticked = threading.Condition()
        self._parked = 0  # under _ticked

    @property
    def parked(self) -> int:
        """How many watches wait for a tick now (SIGUSR1's dump, the tests)."""
        with self._ticked:
            return self._parked

    def tick(self) -> None:
        with self._ticked:
            self._ticked.notify_all()

    def release(self) -> None:
        """Wake every wait once ``stop`` is set, so each returns True."""
        self.tick()

    def wait(self, at_least: float) -> bool:
        """Until the first tick ``at_least`` s from now (less :data:`PACE_SLACK`), or the stop;
        True: stopped."""
        due = self._clock() + at_least - PACE_SLACK
        with self._ticked:
            self._parked += 1
            try:
                while not self._stop.is_set():
                    self._ticked.wait()
                    if self._clock() >= due:
                        break
            finally:
                self._parked -= 1
        return self._stop.is_set()


def watch_key(
    client: MetadataClient,
    kind: NoticeKind,
    stop: threading.Event,
    on_change: Callable[[NoticeKind, bytes | None], None],
    *,
    timeout_sec: int = 60,
    absent_interval: float = ABSENT_INTERVAL,
    pace: TickPace,
) -> None:
    """Call ``on_change(kind, body)`` with the key's value now, then at each change (None: the key
    is absent), until ``stop`` is set and the client closed. Never raises: a bug is logged once a
    streak and the watch starts again after a backoff (:func:`tpuboot.backoff.restarted`).
    ``pace``: the absent key's reads wait for its ticks."""

    def watch(progressed: Callable[[], None]) -> None:
        path = KEYS[kind]
        for change in client.changes(
            path,
            stop=stop,
            timeout_sec=timeout_sec,
            absent_interval=absent_interval,
            absent_wait=pace.wait,
        ):
            on_change(kind, change.value)
            progressed()

    def on_bug(exc: Exception, delay: float, first: bool) -> None:
        if first:
            log.error(
                "notices: the %s watch failed; retrying in %g s (please report it)", kind, delay, exc_info=exc
            )

    restarted(watch, stop, on_bug)
