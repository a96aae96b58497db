"""The three notice keys' values, read into a :class:`Notice` (doc/notices.md has the keys).

Each value is read alone, as it arrives: ``instance/maintenance-event`` (``NONE`` or the event),
``instance/preempted`` (``TRUE`` or ``FALSE``) and ``instance/upcoming-maintenance`` (a JSON
object while maintenance is scheduled, absent otherwise). Nothing a server sends can raise here:
a value tpuboot does not understand is still a notice when it may mean the host goes away (a job
is better warned twice than not at all), and the reason is returned as one line for the log.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Final, Literal

from tpuboot.errors import printable
from tpuboot.gce.keys import INSTANCE

UTC = timezone.utc  # datetime.UTC is 3.11's

#: Which key a notice came from.
NoticeKind = Literal["maintenance", "upcoming", "preempted"]
MAINTENANCE: Final[NoticeKind] = "maintenance"
UPCOMING: Final[NoticeKind] = "upcoming"
PREEMPTED: Final[NoticeKind] = "preempted"
#: Each kind's metadata path, in the order a hook run prefers them (the most urgent first).
KEYS: dict[NoticeKind, str] = {
    PREEMPTED: INSTANCE + "preempted",
    MAINTENANCE: INSTANCE + "maintenance-event",
    UPCOMING: INSTANCE + "upcoming-maintenance",
}
#: The maintenance events the server documents; another value is shown as it came.
MAINTENANCE_EVENTS = ("MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
#: The longest value kept (a notice's value goes to a journal field, an environment variable and
#: a guest attribute).
MAX_VALUE = 80
_FRACTION = re.compile(r"(\.\d+)")


@dataclass(frozen=True)
class Notice:
    """One key's state: ``active`` while it warns of the host going away; ``value`` the server's
    word for it (printable, bounded); ``window_start`` when a scheduled window opens (UTC)."""

    kind: NoticeKind
    active: bool
    value: str
    window_start: datetime | None = None

    def window_text(self) -> str:
        """The window's start as RFC 3339 (UTC, seconds), or "" when not known."""
        if self.window_start is None:
            return ""
        return self.window_start.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def idle(kind: NoticeKind) -> Notice:
    """A key that warns of nothing (its value absent, ``NONE`` or ``FALSE``)."""
    return Notice(kind, False, "NONE" if kind != PREEMPTED else "FALSE")


def parse(kind: NoticeKind, body: bytes | None, now: datetime) -> tuple[Notice, str | None]:
    """The notice in ``body`` (None: the key is absent), and what was odd about it (or None)."""
    text = "" if body is None else body.decode("utf-8", "replace").strip()
    if kind == UPCOMING:
        return parse_upcoming(text, now)
    if not text:
        return idle(kind), None
    value = _shown(text)
    if kind == PREEMPTED:
        if text.upper() == "TRUE":
            return Notice(PREEMPTED, True, "TRUE"), None
        if text.upper() == "FALSE":
            return idle(PREEMPTED), None
        return idle(PREEMPTED), f"preempted is {value!r}, neither TRUE nor FALSE; read as FALSE"
    if text == "NONE":
        return idle(MAINTENANCE), None
    odd = None if text in MAINTENANCE_EVENTS else f"maintenance-event {value!r} is not a known event"
    return Notice(MAINTENANCE, True, value), odd


def parse_upcoming(text: str, now: datetime) -> tuple[Notice, str | None]:
    """``upcoming-maintenance``: absent or empty is none; a JSON object is a notice, its unknown
    fields ignored; a value that is not one is still a notice (of an unknown window)."""
    if not text:
        return idle(UPCOMING), None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return Notice(UPCOMING, True, "UNREADABLE"), "upcoming-maintenance is not JSON; window unknown"
    if not isinstance(data, dict):
        return Notice(
            UPCOMING, True, "UNREADABLE"
        ), "upcoming-maintenance is not a JSON object; window unknown"
    words = [_shown(str(data[field])) for field in ("maintenanceType", "maintenanceStatus") if field in data]
    value = " ".join(words) or "SCHEDULED"
    start, odd = _window_start(data.get("windowStartTime"))
    if start is not None and start < now:
        odd = f"upcoming-maintenance windowStartTime {start:%Y-%m-%dT%H:%M:%SZ} is in the past; kept as given"
    return Notice(UPCOMING, True, value, start), odd


def _window_start(raw: object) -> tuple[datetime | None, str | None]:
    if raw is None:
        return None, None
    if not isinstance(raw, str):
        return None, "upcoming-maintenance windowStartTime is not a string; window unknown"
    # Python 3.10's fromisoformat reads neither "Z" nor nanoseconds (GCE writes both at times).
    text = _FRACTION.sub(lambda m: m[1][:7], raw.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None, f"upcoming-maintenance windowStartTime {_shown(raw)!r} is not a time; window unknown"
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)  # the server writes UTC; a bare time is read so
    return when.astimezone(UTC), None


def _shown(text: str) -> str:
    return printable(text[:MAX_VALUE])


def status_detail(notices: list[Notice]) -> str:
    """STATUS's words for the active notices, the most urgent first ("" when none is active)."""
    words = []
    for notice in notices:
        if not notice.active:
            continue
        if notice.kind == PREEMPTED:
            words.append("preempted: shutting down")
        elif notice.kind == MAINTENANCE:
            how = {"TERMINATE_ON_HOST_MAINTENANCE": "terminate", "MIGRATE_ON_HOST_MAINTENANCE": "migrate"}
            words.append(f"host maintenance now ({how.get(notice.value, notice.value)})")
        else:
            at = "" if notice.window_start is None else f" at {notice.window_start:%Y-%m-%d %H:%M} UTC"
            words.append(f"host maintenance{at} ({notice.value.lower()})")
    return "; ".join(words)
