"""What one tpu-env sync did, and how it is told: one status line for people, a log line, a metric.

A result is logged when it is news: the watch's first look at an attribute still unset is said
already, and a long-poll's new ETag over the same value (``confirmed``) is no news at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from tpuboot import metrics

log = logging.getLogger("tpuboot.env.results")


#: Where a sync's values came from: the metadata server, the cache, nowhere (the attribute is
#: absent), or it failed.
Source = Literal["metadata", "cache", "absent", "failed"]


@dataclass(frozen=True)
class SyncResult:
    """What one sync did: its :data:`Source`, and ``status``, one line for people."""

    source: Source
    keys: int
    etag: str | None
    status: str
    tpu_env_written: bool = False
    environment_written: bool = False
    #: The metadata value was the one last written (a long-poll's new ETag over the same body):
    #: the files are checked, nothing is rewritten, nothing is logged.
    confirmed: bool = False


def keys(count: int) -> str:
    """``1 key``, ``3 keys``: as the status line counts."""
    return f"{count} key" if count == 1 else f"{count} keys"


class Reporter:
    """Logs each result that is news and counts each write (not thread-safe: one per EnvSync,
    whose results come one at a time)."""

    def __init__(self) -> None:
        self._reported: SyncResult | None = None

    def __call__(self, result: SyncResult) -> None:
        if result.source in ("metadata", "cache"):
            metrics.tpu_env_updated(from_cache=result.source == "cache")
        last, self._reported = self._reported, result
        if result.source == "absent" and last is not None and last.status == result.status:
            return  # the watch's first look at an attribute still unset: said already
        unchanged = last is not None and last.status == result.status and not result.tpu_env_written
        if result.confirmed and unchanged:
            log.debug("tpu-env: unchanged under ETag %s", result.etag)  # a flapping ETag: no news
            return
        level = logging.INFO if result.source in ("metadata", "absent") else logging.WARNING
        log.log(
            level,
            "%s",
            result.status,
            extra={
                "TPU_ENV_SOURCE": result.source,
                "TPU_ENV_KEYS": result.keys,
                "METADATA_ETAG": result.etag or "",
            },
        )


class Bugs:
    """Logs an unexpected exception (a bug) with its traceback the first time; repeats at debug
    level until ``clear`` (a good result) makes the next one news again."""

    def __init__(self, path: str) -> None:
        self.path = path  # the tpu-env file, for the journal's TPU_ENV_PATH
        self._seen: set[str] = set()

    def __call__(self, exc: Exception, where: str) -> None:
        kind = f"{where.split(' (')[0]}: {type(exc).__name__}: {exc}"[:300]
        if kind in self._seen:
            log.debug("%s: %s again", where, type(exc).__name__)
            return
        self._seen.add(kind)
        log.error(
            "%s: unexpected %s: %s; this is a bug in tpuboot, please report it",
            where,
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
            exc_info=exc,
            extra={"TPU_ENV_PATH": self.path},
        )

    def clear(self) -> None:
        self._seen.clear()
