"""tpuboot's one backoff policy: a wait that doubles from ``initial`` up to ``maximum``.

Every retry in tpuboot waits by it: the metadata client's tries and watch (with full jitter above a
floor, so a fleet booting together does not ask in lockstep), the watches' restart after a
bug, a failed bind's next try (tpuboot/devices/manager.py), a supervised container's restart
(:class:`RestartPolicy`, reset after a stable run) and the metrics endpoint's next accept after
one found no fd or memory to spare (tpuboot/metrics_server.py). The policies are pure: time and randomness are
passed in, so they are tested without sleeping; :func:`restarted` is the one loop that waits by one
(a watch thread's restart after a bug).
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: Exits in a row (each after a run shorter than ``stable_after``) that make a crash loop.
CRASH_LOOP_EXITS = 3
#: The exponent is capped before the power: 2.0 ** 1100 would overflow a float.
_MAX_EXPONENT = 64
#: A watch's wait after a bug (:func:`restarted`): first, doubling up to the maximum.
WATCH_RETRY = (1.0, 300.0)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: wait n is at most ``ceiling(n)`` = min(maximum, initial * 2**n).

    ``delay`` draws with full jitter above a floor, floor + U(0, ceiling(n)): the jitter spreads a
    fleet's retries; the floor caps one host at 1/floor requests a second (2/s by default)
    whatever the jitter draws; the maximum bounds the wait once the other side is back.
    """

    initial: float = 1.0
    maximum: float = 4.0
    floor: float = 0.5

    def ceiling(self, attempt: int) -> float:
        """The wait after ``attempt`` failures before (0: the first retry), without jitter or floor."""
        return min(self.maximum, self.initial * 2.0 ** min(max(attempt, 0), _MAX_EXPONENT))

    def delay(self, attempt: int, rng: random.Random) -> float:
        return self.floor + rng.uniform(0.0, self.ceiling(attempt))


class RestartSettings(Protocol):
    """What :meth:`RestartPolicy.from_config` reads (the config's ``supervisor`` section)."""

    @property
    def backoff_initial(self) -> float: ...
    @property
    def backoff_max(self) -> float: ...
    @property
    def stable_after(self) -> float: ...


@dataclass
class RestartPolicy:
    """``delay_after(ran_for)``: how long to wait before the next start, after a run of ``ran_for`` s.

    The first exit waits ``initial``, each further exit in a row doubles it up to ``maximum``
    (:class:`Backoff` without jitter); a run of at least ``stable_after`` seconds starts the
    sequence again.
    """

    initial: float = 1.0
    maximum: float = 300.0
    stable_after: float = 600.0
    exits: int = 0  # exits in a row, each after a short run

    @classmethod
    def from_config(cls, config: RestartSettings) -> RestartPolicy:
        return cls(config.backoff_initial, config.backoff_max, config.stable_after)

    def delay_after(self, ran_for: float) -> float:
        if ran_for >= self.stable_after:
            self.exits = 0
        delay = Backoff(self.initial, self.maximum, floor=0.0).ceiling(self.exits)
        self.exits += 1
        return delay

    @property
    def crash_loop(self) -> bool:
        return self.exits >= CRASH_LOOP_EXITS

    def reset(self) -> None:
        self.exits = 0


def restarted(
    watch: Callable[[Callable[[], None]], None],
    stop: threading.Event,
    on_bug: Callable[[Exception, float, bool], None],
    retry: tuple[float, float] = WATCH_RETRY,
) -> None:
    """Run ``watch(progressed)`` until it returns or ``stop`` is set; never raises.

    A watch thread must outlive its bugs (a daemon whose watch died would never hear the server
    again): after an exception, ``on_bug(exc, delay, first)`` (``first``: the first of a streak,
    so a log line is said once) and ``watch`` again after ``delay``, which doubles along the streak;
    ``progressed()``, called by the watch at each change it handled, ends the streak. An exception
    once ``stop`` is set is the shutdown cutting the watch short, not a bug.
    """
    backoff = RestartPolicy(*retry, stable_after=math.inf)
    while not stop.is_set():
        try:
            watch(backoff.reset)
            return
        except Exception as exc:
            if stop.is_set():
                return
            delay = backoff.delay_after(0.0)
            on_bug(exc, delay, backoff.exits == 1)
            if stop.wait(delay):
                return
