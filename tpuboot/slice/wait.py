"""`tpuboot wait-slice`: look at the slice again and again until it holds, for a job unit's
``ExecStartPre=`` beside ``wait-free``.

Nothing notifies a worker that a peer's firewall rule changed or its metadata arrived, so the look
is repeated every ``interval`` seconds; a look costs at most one connect timeout. Each time what is
wrong changes, it is said (``on_change``), so a log shows progress rather than silence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tpuboot.errors import MetadataError
from tpuboot.slice.verdict import SliceReport

#: Seconds between two looks: a fixed firewall is seen within one interval and one connect timeout.
POLL_INTERVAL = 1.0


def wrong(report: SliceReport) -> list[str]:
    """What is still wrong, one line each (the FAILs)."""
    return [f"{f.name}: {f.detail}" for f in report.findings if f.status == "FAIL"]


def wait_slice(
    look: Callable[[float], SliceReport],
    timeout: float,
    on_change: Callable[[list[str]], None],
    interval: float = POLL_INTERVAL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """[] once a look holds; what is still wrong when ``timeout`` seconds have passed.

    ``look(deadline_s)`` makes one look within ``deadline_s``; a metadata server that does not
    answer is what is wrong for that look, and the wait goes on.
    """
    deadline = clock() + timeout
    last: list[str] | None = None
    while True:
        try:
            now_wrong = wrong(look(max(0.1, deadline - clock())))
        except MetadataError as exc:
            now_wrong = [f"metadata: {exc}"]
        if not now_wrong:
            return []
        if now_wrong != last:
            on_change(now_wrong)
            last = now_wrong
        left = deadline - clock()
        if left <= 0:
            return now_wrong
        sleep(min(interval, left))
