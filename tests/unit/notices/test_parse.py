"""The notice keys' values read into Notices: the documented ones, and what a server could send
that tpuboot does not expect (never an exception, one reason for the log)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from tpuboot.notices.parse import MAINTENANCE, PREEMPTED, UPCOMING, UTC, Notice, idle, parse, status_detail

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SCHEDULED = {
    "maintenanceType": "SCHEDULED",
    "windowStartTime": "2026-12-05T14:05:00Z",
    "windowEndTime": "2026-12-05T18:05:00Z",
    "latestWindowStartTime": "2026-12-06T14:05:00Z",
    "canReschedule": True,
    "maintenanceStatus": "PENDING",
}


def test_the_documented_values() -> None:
    assert parse(MAINTENANCE, b"NONE", NOW) == (idle(MAINTENANCE), None)
    terminate = parse(MAINTENANCE, b"TERMINATE_ON_HOST_MAINTENANCE", NOW)
    assert terminate == (Notice(MAINTENANCE, True, "TERMINATE_ON_HOST_MAINTENANCE"), None)
    assert parse(PREEMPTED, b"FALSE", NOW) == (idle(PREEMPTED), None)
    assert parse(PREEMPTED, b"TRUE\n", NOW) == (Notice(PREEMPTED, True, "TRUE"), None)
    notice, odd = parse(UPCOMING, json.dumps(SCHEDULED).encode(), NOW)
    assert odd is None
    assert notice == Notice(UPCOMING, True, "SCHEDULED PENDING", datetime(2026, 12, 5, 14, 5, tzinfo=UTC))
    assert notice.window_text() == "2026-12-05T14:05:00Z"
    assert parse(UPCOMING, None, NOW) == (idle(UPCOMING), None)  # absent: nothing scheduled


def test_unknown_fields_are_ignored_and_fractional_or_offset_times_read() -> None:
    for start in ("2026-12-05T15:05:00.123+01:00", "2026-12-05T14:05:00.123456789Z", "2026-12-05T14:05:00"):
        data = {**SCHEDULED, "futureField": {"x": [1]}, "windowStartTime": start}
        notice, odd = parse(UPCOMING, json.dumps(data).encode(), NOW)
        assert odd is None
        assert notice.window_text() == "2026-12-05T14:05:00Z"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "is not JSON"),
        (b"[1, 2]", "is not a JSON object"),
        (b'{"windowStartTime": 7}', "windowStartTime is not a string"),
        (b'{"windowStartTime": "soon"}', "'soon' is not a time"),
        (b"\xff\xfe{", "is not JSON"),
        (b"[" * 100000, "is not JSON"),
    ],
)
def test_an_upcoming_value_that_cannot_be_read_is_still_a_notice_of_an_unknown_window(
    body: bytes, reason: str
) -> None:
    notice, odd = parse(UPCOMING, body, NOW)
    assert notice.active and notice.window_start is None
    assert odd is not None and reason in odd


def test_a_window_in_the_past_is_kept_and_said() -> None:
    data = {**SCHEDULED, "windowStartTime": "2026-12-05T11:00:00Z", "maintenanceStatus": "ONGOING"}
    notice, odd = parse(UPCOMING, json.dumps(data).encode(), NOW)
    assert notice.window_text() == "2026-12-05T11:00:00Z" and notice.value == "SCHEDULED ONGOING"
    assert odd == "upcoming-maintenance windowStartTime 2026-12-05T11:00:00Z is in the past; kept as given"


def test_odd_words_are_shown_printably_and_bounded() -> None:
    notice, odd = parse(MAINTENANCE, b"EVIL\x1b[2J" + b"X" * 500, NOW)
    assert notice.active and "\x1b" not in notice.value and len(notice.value) < 100
    assert odd is not None and "not a known event" in odd
    assert parse(PREEMPTED, b"maybe", NOW)[0] == idle(PREEMPTED)  # never a preemption it did not say


def test_status_words() -> None:
    upcoming = Notice(UPCOMING, True, "SCHEDULED PENDING", datetime(2026, 12, 5, 14, 5, tzinfo=UTC))
    maintenance = Notice(MAINTENANCE, True, "TERMINATE_ON_HOST_MAINTENANCE")
    assert status_detail([idle(PREEMPTED), idle(MAINTENANCE), upcoming]) == (
        "host maintenance at 2026-12-05 14:05 UTC (scheduled pending)"
    )
    assert status_detail([Notice(PREEMPTED, True, "TRUE"), maintenance, idle(UPCOMING)]) == (
        "preempted: shutting down; host maintenance now (terminate)"
    )
    assert status_detail([idle(PREEMPTED), idle(MAINTENANCE), idle(UPCOMING)]) == ""
