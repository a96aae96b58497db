"""Servers that trickle: what the deadline tests of the metadata client and the Docker client share.

The bound each case gets is HANG times its deadline: only a hang passes it, never a loaded machine;
what proves the deadline is the outcome (the call cut, 'timed out'), as no test asserts timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

TRICKLE = 0.3  # seconds between bytes: far inside every per-receive timeout of the tests


HANG = 10  # a bound, as a multiple of the deadline, that only a call the deadline did not end passes


def timed(work: Callable[[], Any], bound: float) -> Any:
    """Run ``work`` in a thread: its result or exception; fails (not hangs) if it runs past ``bound``."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(bound)
    elapsed = time.monotonic() - started
    assert not worker.is_alive(), f"still running after {elapsed:.1f} s (bound {bound:g} s)"
    return outcome[0]
