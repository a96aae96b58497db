"""Each kind of failure of each metadata URL logged once, and its recovery once.

As compute-image-packages' metadata_watcher does: a flapping server (dropped, timed out, dropped,
...) costs one line per kind, not one per try.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("tpuboot.gce.failures")


class FailureLog:
    """Logs each kind of failure of each URL once until that URL is answered again, then the
    recovery once.

    Per URL: one client serves tpu-env, the guest attributes and the GKE check, and an answer to one
    says nothing of another (a guest-attribute write that works while tpu-env fails is not
    "answering again" for tpu-env).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kinds: dict[str, list[str]] = {}  # url -> kinds logged since it last answered

    def failed(self, kind: str, url: str, retrying: bool) -> None:
        with self._lock:
            kinds = self._kinds.setdefault(url, [])
            if kind in kinds:
                return
            kinds.append(kind)
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
            kinds = self._kinds.pop(url, [])
        if kinds:
            was = ", ".join(kinds)
            log.info("metadata server %s: answering again (was: %s)", url, was, extra={"METADATA_URL": url})
