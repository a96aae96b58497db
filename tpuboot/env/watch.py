"""The tpu-env watch: rewrite tpu-env on each change of the attribute, and never end by a bug.

It continues from the ETag of the last sync (without one it first reads and writes the current
value), and ends when ``stop`` is set and the metadata client is closed (``close()`` cuts a
long-poll in flight; nothing polls ``stop``, so an idle watch never wakes up). Every failure the
metadata server or the value can cause is handled where it arises; anything else is a bug, logged
once with its traceback and reported once per streak as a failed result, and the watch starts
again after a backoff (1 s doubling to 5 min) from the last value it wrote. This is tpuboot's one
restart of the watch: the daemon's env service runs it as it is.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from tpuboot.backoff import RestartPolicy
from tpuboot.env.results import Bugs, SyncResult
from tpuboot.gce.replies import Change

#: The watch's wait after an unexpected exception: first, doubling up to the maximum.
WATCH_RETRY_FIRST = 1.0
WATCH_RETRY_MAX = 300.0


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
    retry: tuple[float, float] = (WATCH_RETRY_FIRST, WATCH_RETRY_MAX),
) -> None:
    """Apply each change until ``stop`` is set; ``on_result`` after each. Never raises (see above).

    ``retry``: the first wait after a bug and the most it doubles to.
    """
    backoff = RestartPolicy(*retry, stable_after=math.inf)
    while not stop.is_set():
        try:
            for change in sync.changes(stop):
                result = sync.apply(change)
                sync.report(result)
                on_result(result)
                backoff.reset()
                sync.bugs.clear()
            return  # the changes end only when stop is set or the client is closed
        except Exception as exc:
            if stop.is_set():
                return  # shutting down: the loop reports go to may be closed already
            delay = backoff.delay_after(0.0)
            sync.bugs(exc, f"tpu-env watch (retrying in {delay:g} s)")
            failed = SyncResult(
                "failed",
                0,
                sync.etag,
                f"tpu-env: watch failed ({type(exc).__name__}); left {sync.tpu_env_path} as it was",
            )
            if backoff.exits == 1:  # once per streak: STATUS shows it, the log is not flooded
                _tell(sync, on_result, failed)
            if stop.wait(delay):
                return


def _tell(sync: Watched, on_result: Callable[[SyncResult], None], result: SyncResult) -> None:
    try:
        sync.report(result)
        on_result(result)
    except Exception as exc:
        sync.bugs(exc, "tpu-env watch report")
