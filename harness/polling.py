"""Waiting, in the caller's thread, until a condition that another thread or process makes holds.

The one polling helper of the unit tests, the VM tests and the harness. It bounds a wait and fails
the test when the bound passes; no test asserts on how long the wait took.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> None:
    """Return once ``predicate()`` is true; fail (AssertionError) if it is still false after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not reached in {timeout} s"
        time.sleep(interval)
