"""The restart policy of a supervised container: capped exponential backoff, reset after a stable run.

Pure: time is passed in, so the policy is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuboot.config import SupervisorConfig

#: Exits in a row (each after a run shorter than ``stable_after``) that make a crash loop.
CRASH_LOOP_EXITS = 3


@dataclass
class RestartPolicy:
    """``delay_after(ran_for)``: how long to wait before the next start, after a run of ``ran_for`` s.

    The first exit waits ``initial``, each further exit in a row doubles it up to ``maximum``;
    a run of at least ``stable_after`` seconds starts the sequence again.
    """

    initial: float = 1.0
    maximum: float = 300.0
    stable_after: float = 600.0
    exits: int = 0  # exits in a row, each after a short run

    @classmethod
    def from_config(cls, config: SupervisorConfig) -> RestartPolicy:
        return cls(config.backoff_initial, config.backoff_max, config.stable_after)

    def delay_after(self, ran_for: float) -> float:
        if ran_for >= self.stable_after:
            self.exits = 0
        delay = min(self.maximum, self.initial * 2.0 ** min(self.exits, 64))
        self.exits += 1
        return delay

    @property
    def crash_loop(self) -> bool:
        return self.exits >= CRASH_LOOP_EXITS

    def reset(self) -> None:
        self.exits = 0
