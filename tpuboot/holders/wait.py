"""`tpuboot wait-free`: wait until every chip and lock is free, for a job unit's ExecStartPre=.

/proc has no change notification (inotify reports nothing on it), so the scan is repeated at a
modest interval: one pass over /proc/*/fd a second costs a few percent of one core on a busy host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tpuboot.holders.report import Report

#: Seconds between two looks.
POLL_INTERVAL = 1.0


def wait_free(
    look: Callable[[], Report],
    timeout: float,
    interval: float = POLL_INTERVAL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Report:
    """The first report that is free, or the last one when ``timeout`` seconds have passed."""
    deadline = clock() + timeout
    while True:
        report = look()
        left = deadline - clock()
        if report.free or left <= 0:
            return report
        sleep(min(interval, left))
