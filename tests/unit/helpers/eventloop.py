"""A selector that counts the event loop's wake-ups (the idle tests of the loop and the daemon)."""

from __future__ import annotations

import selectors


class CountingSelector(selectors.DefaultSelector):
    """The default selector, counting how often the loop came out of it."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def select(self, timeout: float | None = None):
        events = super().select(timeout)
        self.wakeups += 1
        return events
