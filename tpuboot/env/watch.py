"""The tpu-env watch: rewrite tpu-env on each change of the attribute, and never end by a bug.

It continues from the ETag of the last sync (without one it first reads and writes the current
value), and ends when ``stop`` is set and the metadata client is closed (``close()`` cuts a
long-poll in flight; nothing polls ``stop``, so an idle watch never wakes up). Every failure the
metadata server or the value can cause is handled where it arises; anything else is a bug, logged
once with its traceback and reported once per streak as a failed result, and the watch starts
again after a backoff (1 s doubling to 5 min, :func:`tpuboot.backoff.restarted`) from the last value
it wrote. The daemon's env service runs it as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from tpuboot.backoff import WATCH_RETRY, restarted
from tpuboot.env.results import Bugs, SyncResult
from tpuboot.gce.replies import Change


class Watched(Protocol):
    """What the watch uses of its sync (:class:`tpuboot.env.sync.EnvSync`)."""

    @property
    def bugs(self) -> Bugs: ...
    @property
    def etag(self) -> str | None: ...
    @property
    def tpu_env_path(self) -> str: ...
    def changes(self, stop: threading.Event) -> Iterator[Change]: ...
    def apply(self, change: Change) -> SyncResult: ...
    def report(self, result: SyncResult) -> None: ...


def watch_tpu_env(
    sync: Watched,
    stop: threading.Event,
    on_result: Callable[[SyncResult], None],
    *,
    retry: tuple[float, float] = WATCH_RETRY,
) -> None:
    """Apply each change until ``stop`` is set; ``on_result`` after each. Never raises (see above).

    ``retry``: the first wait after a bug and the most it doubles to.
    """

    def watch(progressed: Callable[[], None]) -> None:
        for change in sync.changes(stop):  # they end only when stop is set or the client is closed
            result = sync.apply(change)
            sync.report(result)
            on_result(result)
            progressed()
            sync.bugs.clear()

    def on_bug(exc: Exception, delay: float, first: bool) -> None:
        sync.bugs(exc, f"tpu-env watch (retrying in {delay:g} s)")
        if first:  # once per streak: STATUS shows it, the log is not flooded
            why = f"tpu-env: watch failed ({type(exc).__name__}); left {sync.tpu_env_path} as it was"
            _tell(sync, on_result, SyncResult("failed", 0, sync.etag, why))

    restarted(watch, stop, on_bug, retry)


def _tell(sync: Watched, on_result: Callable[[SyncResult], None], result: SyncResult) -> None:
    try:
        sync.report(result)
        on_result(result)
    except Exception as exc:
        sync.bugs(exc, "tpu-env watch report")
