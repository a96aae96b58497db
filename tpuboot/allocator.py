"""The daemon's one allocator setting: glibc's mmap threshold fixed at its starting 128 KiB.

glibc raises the threshold each time a block it had mapped is freed, up to that block's size (its
"dynamic mmap threshold"): after the first 1 MiB answer from the metadata server, every later
block up to 1 MiB comes from the arenas, and freeing them leaves free memory there that is rarely
given back. Over a life of hotplug and metadata faults that free memory grew without end while
the bytes in use levelled off (doc/performance.md, "What grows in the daemon's own process");
with the threshold fixed, a large block is mapped and unmapped whole and it stayed flat. Set in
the process (mallopt), not by MALLOC_MMAP_THRESHOLD_ in the unit's environment, which every child
(vBar's exec runtime, the notice hooks) would inherit.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("tpuboot.allocator")

#: mallopt's parameter number for the threshold (glibc's malloc.h), and the value: glibc's default.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> bool:
    """Fix the threshold (turning off its growth); False where the C library has no mallopt (not
    glibc) or refuses, which is said at debug level: the daemon runs the same, with more memory."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as exc:
        log.debug("allocator: no mallopt (%s); the mmap threshold is the C library's", exc)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.debug("allocator: mallopt refused M_MMAP_THRESHOLD %d", MMAP_THRESHOLD)
        return False
    return True
