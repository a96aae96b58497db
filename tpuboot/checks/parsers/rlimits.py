"""A resource limit as pam_limits and systemd give it: soft and hard values and where they come
from, the record both readers return and the limit checks judge."""

from __future__ import annotations

import math
from dataclasses import dataclass

UNLIMITED = math.inf


@dataclass(frozen=True)
class Limit:
    """A resource limit and where it comes from; soft or hard None: not set, a default applies."""

    soft: float | None
    hard: float | None
    source: str

    def at_least(self, minimum: float) -> bool:
        return all(value is not None and value >= minimum for value in (self.soft, self.hard))

    def __str__(self) -> str:
        if self.soft is None and self.hard is None:
            return self.source

        def show(value: float | None) -> str:
            if value is None:
                return "default"
            return "unlimited" if value == UNLIMITED else str(int(value))

        text = show(self.soft) if self.soft == self.hard else f"{show(self.soft)}:{show(self.hard)}"
        return f"{text} ({self.source})"


NOT_SET = Limit(None, None, "not set")
