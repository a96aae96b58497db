"""`tpuboot wait-maintenance`: wait until the daemon's notice file says the host is going away.

A bounded poll of the file's identity (inode, size, change time) every ``interval`` seconds, the
file read again only when that changed: a stat a tick, cheap enough for a training loop's own
thread, and the same file the hooks' daemon writes, so a job and the hooks never disagree. (No
inotify: it would need a C binding or ctypes for one syscall, and the file's directory may not
exist yet when the job starts.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from tpuboot.atomicfile import FileError
from tpuboot.notices import noticefile
from tpuboot.paths import Root

#: Seconds between two looks at the file.
INTERVAL = 0.5


def current(root: Root, kinds: Iterable[str] | None = None) -> list[dict[str, Any]] | None:
    """The active notices (of ``kinds``) now; None when the file is absent or unreadable."""
    try:
        data = noticefile.load(root)
    except FileError:
        return None
    return None if data is None else noticefile.active(data, kinds)


def wait(
    root: Root,
    timeout: float | None,
    kinds: Iterable[str] | None = None,
    *,
    interval: float = INTERVAL,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict[str, Any]]:
    """The active notices once there is one (of ``kinds``); [] when ``timeout`` passes first."""
    wanted = None if kinds is None else tuple(kinds)
    end = None if timeout is None else clock() + timeout
    seen: tuple[int, int, int] | None = None
    path = root.path(noticefile.NOTICE_PATH)
    while True:
        try:
            info = os.stat(path)
            identity = (info.st_ino, info.st_size, info.st_ctime_ns)
        except OSError:
            identity = (0, 0, 0)
        if identity != seen:
            seen = identity
            active = current(root, wanted)
            if active:
                return active
        if end is not None and clock() >= end:
            return []
        sleep(interval if end is None else max(0.0, min(interval, end - clock())))
