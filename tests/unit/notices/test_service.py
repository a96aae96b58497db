"""The notice part end to end against the metadata emulator on 127.0.0.1: the three keys watched
over real long-polls, each notice told (status, file, metrics, journal) and the hooks run; a value
flapping every change costs no log storm and no repeated hook runs; the daemon shows it."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from harness.mds_emulator import UPCOMING_MAINTENANCE, MetadataEmulator
from harness.polling import wait_until
from tests.unit.helpers.metadata import make_client
from tpuboot import metrics
from tpuboot.gce.replies import Change
from tpuboot.metrics_catalog import MAINTENANCE_WINDOW_START, NOTICE
from tpuboot.notices import noticefile
from tpuboot.notices.hooks import HOOKS_DIR
from tpuboot.notices.parse import UTC
from tpuboot.notices.service import Notices, NoticeSettings
from tpuboot.paths import Root

SCHEDULED = {
    "maintenanceType": "SCHEDULED",
    "windowStartTime": "2099-12-05T14:05:00Z",
    "maintenanceStatus": "PENDING",
    "someNewField": 1,
}


@pytest.fixture
def tree(tmp_path: Path) -> Root:
    hooks = tmp_path / "root" / HOOKS_DIR.lstrip("/")
    hooks.mkdir(parents=True)
    os.chmod(hooks, 0o755)
    return Root(tmp_path / "root")


@pytest.fixture
def part(
    tree: Root, emulator: MetadataEmulator, recorded: metrics.Metrics
) -> Iterator[tuple[Notices, list[int]]]:
    client = make_client(emulator)
    notices = Notices(tree, client, NoticeSettings(hook_deadline=10.0), timeout_sec=30, absent_interval=0.05)
    reports: list[int] = []
    notices.start(lambda: reports.append(1))
    try:
        yield notices, reports
    finally:
        notices.stop()
        client.close()


def file_data(root: Root) -> dict[str, object] | None:
    return noticefile.load(root)


def ticked(notices: Notices) -> bool:
    """The daemon's tick, at each poll of a wait: an absent key's watch reads it again then."""
    notices.tick(None)
    return True


def test_maintenance_then_preemption_reach_the_status_file_metrics_and_hooks(
    part: tuple[Notices, list[int]], tree: Root, emulator: MetadataEmulator, tmp_path: Path,
    recorded: metrics.Metrics, caplog,
) -> None:  # fmt: skip
    notices, reports = part
    out = tmp_path / "hooked"
    hook = tree.path(f"{HOOKS_DIR}/10-checkpoint")
    hook.write_text(f'#!/bin/sh\necho "$1 $2" >> {out}\n')
    os.chmod(hook, 0o755)
    caplog.set_level(logging.INFO, "tpuboot.notices")
    wait_until(lambda: file_data(tree) == {"active": False, "notices": []})
    assert notices.status().state == "quiet" and notices.attribute() == "none"
    assert recorded.series(NOTICE) == {("preempted",): 0.0, ("maintenance",): 0.0, ("upcoming",): 0.0}

    emulator.announce(upcoming=SCHEDULED)
    wait_until(lambda: ticked(notices) and out.exists() and out.read_text() == "upcoming SCHEDULED PENDING\n")
    assert notices.status().detail == "host maintenance at 2099-12-05 14:05 UTC (scheduled pending)"
    window = datetime(2099, 12, 5, 14, 5, tzinfo=UTC).timestamp()
    assert recorded.series(MAINTENANCE_WINDOW_START) == {(): window}
    assert notices.attribute() == "upcoming=SCHEDULED_PENDING@2099-12-05T14:05:00Z"

    emulator.announce(maintenance="TERMINATE_ON_HOST_MAINTENANCE")
    wait_until(lambda: out.read_text().count("\n") == 2)
    emulator.announce(preempted=True)
    wait_until(lambda: out.read_text().count("\n") == 3)
    assert out.read_text().splitlines()[1:] == ["maintenance TERMINATE_ON_HOST_MAINTENANCE", "preempted TRUE"]
    assert notices.status().detail == (
        "preempted: shutting down; host maintenance now (terminate); "
        "host maintenance at 2099-12-05 14:05 UTC (scheduled pending)"
    )
    data = file_data(tree)
    assert data is not None and data["active"] is True
    assert [n["kind"] for n in data["notices"]] == ["preempted", "maintenance", "upcoming"]  # type: ignore[index]
    assert recorded.series(NOTICE) == {("preempted",): 1.0, ("maintenance",): 1.0, ("upcoming",): 1.0}
    said = [r for r in caplog.records if r.getMessage().startswith("notice: preempted")]
    assert len(said) == 1 and said[0].NOTICE_KIND == "preempted" and said[0].NOTICE_VALUE == "TRUE"
    assert reports  # the daemon was told

    emulator.announce(upcoming={}, maintenance="NONE", preempted=False)
    wait_until(lambda: file_data(tree) == {"active": False, "notices": []})
    wait_until(lambda: notices.status().state == "quiet")  # STATUS follows the file, never runs ahead
    assert recorded.series(MAINTENANCE_WINDOW_START) == {}  # set before the file is


def test_a_value_flapping_at_every_poll_runs_the_hooks_once_and_logs_a_line_a_minute(
    part: tuple[Notices, list[int]], tree: Root, emulator: MetadataEmulator, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "hooked"
    hook = tree.path(f"{HOOKS_DIR}/10-count")
    hook.write_text(f"#!/bin/sh\necho x >> {out}\n")
    os.chmod(hook, 0o755)
    caplog.set_level(logging.INFO, "tpuboot.notices")
    wait_until(lambda: file_data(tree) is not None)
    for n in range(20):
        emulator.announce(maintenance="TERMINATE_ON_HOST_MAINTENANCE" if n % 2 == 0 else "NONE")
        wait_until(lambda n=n: _maintenance_active(tree) == (n % 2 == 0))
    wait_until(lambda: out.exists())
    lines = [r for r in caplog.records if r.getMessage().startswith("notice: maintenance")]
    assert len(lines) == 1  # the first; the 19 changes after it fall in its quiet minute
    assert out.read_text() == "x\n"  # the same notice within REPEAT_AFTER: the hooks ran once


def _maintenance_active(root: Root) -> bool:
    data = noticefile.load(root)
    return data is not None and any(n["kind"] == "maintenance" for n in data["notices"])


def test_a_hook_that_hangs_never_holds_the_next_notice_from_the_file_and_status(
    part: tuple[Notices, list[int]], tree: Root, emulator: MetadataEmulator, tmp_path: Path
) -> None:
    notices, _ = part
    started = tmp_path / "started"
    hook = tree.path(f"{HOOKS_DIR}/10-hangs")
    hook.write_text(f'#!/bin/sh\necho "$1" >> {started}\nexec sleep 1000\n')
    os.chmod(hook, 0o755)
    wait_until(lambda: file_data(tree) is not None)
    emulator.announce(maintenance="TERMINATE_ON_HOST_MAINTENANCE")
    wait_until(lambda: started.exists())
    emulator.announce(preempted=True)  # while the hook hangs
    wait_until(lambda: notices.status().detail.startswith("preempted: shutting down"))
    data = file_data(tree)
    assert data is not None and data["notices"][0]["kind"] == "preempted"  # type: ignore[index]
    # queued, then run once the hung hook is killed at the (10 s) deadline
    wait_until(lambda: started.read_text() == "maintenance\npreempted\n", timeout=30)


def test_stop_removes_the_file_and_ends_the_threads(tree: Root, emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    notices = Notices(tree, client, NoticeSettings(), timeout_sec=30)
    notices.start(lambda: None)
    wait_until(lambda: file_data(tree) is not None)
    notices.stop()
    client.close()
    assert file_data(tree) is None
    wait_until(lambda: not any(thread.is_alive() for thread in notices._threads))


def test_the_emulator_serves_the_keys_with_etags_and_wakes_long_polls(emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    try:
        first = client.get("instance/maintenance-event", deadline_s=5)
        assert first.text == "NONE" and first.etag
        box: dict[str, str] = {}
        poll = threading.Thread(
            target=lambda: box.update(
                text=client.wait_for_change(
                    "instance/maintenance-event", etag=first.etag, timeout_sec=30
                ).text
            )
        )
        poll.start()
        assert emulator.wait_for_pollers(1)
        emulator.announce(maintenance="TERMINATE_ON_HOST_MAINTENANCE")
        poll.join(10)
        assert box == {"text": "TERMINATE_ON_HOST_MAINTENANCE"}
        assert client.get("instance/preempted", deadline_s=5).text == "FALSE"
        emulator.announce(upcoming=SCHEDULED)
        assert json.loads(client.get(UPCOMING_MAINTENANCE, deadline_s=5).text) == SCHEDULED
    finally:
        client.close()


def test_the_daemon_says_ready_without_waiting_and_shows_a_notice_in_status_and_attributes(
    tree: Root, emulator: MetadataEmulator, tmp_path: Path
) -> None:
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.daemon import DEVICES_ONLY, guest_attribute_values, make, serving, until
    from tpuboot.config import MetadataConfig, NoticesConfig

    config = DEVICES_ONLY.replace(notices=NoticesConfig(), metadata=MetadataConfig(host=emulator.host))
    emulator.set_faults(delay=3600.0)  # no answer at all: READY must not wait for the watch
    daemon, _, notifier = make(FakeKernel(tmp_path), config=config, root=tree, metadata=make_client(emulator))
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=no TPUs found"
        emulator.set_faults()
        emulator.announce(preempted=True)
        until(lambda: notifier.last_status.endswith("; preempted: shutting down"))
        assert guest_attribute_values(daemon)["notice"] == "preempted=TRUE"
        running.stop()


def test_doctor_reads_the_file_the_daemon_writes(tree: Root) -> None:
    from tpuboot.checks.notices import check_notice
    from tpuboot.config import Config, NoticesConfig
    from tpuboot.notices.parse import PREEMPTED, Notice, idle

    assert check_notice(tree, Config()).status == "SKIP"
    off = Config(notices=NoticesConfig(enabled=False))
    assert check_notice(tree, off).detail.startswith("notices.enabled")
    noticefile.save(tree, [idle(PREEMPTED)])
    assert check_notice(tree, Config()).status == "PASS"
    noticefile.save(tree, [Notice(PREEMPTED, True, "TRUE")])
    result = check_notice(tree, Config())
    assert (result.status, result.detail) == ("WARN", "the host is going away: preempted TRUE")
    tree.path(noticefile.NOTICE_PATH).write_text("[garbage")
    assert check_notice(tree, Config()).status == "WARN"


def test_an_absent_key_is_read_at_the_tick_with_no_timer_of_its_own(
    part: tuple[Notices, list[int]], tree: Root, emulator: MetadataEmulator
) -> None:
    """upcoming-maintenance, absent, waits for the daemon's tick (its absent_interval, 0.05 s here,
    long past): announced, it is read at the next tick and long-polled from then on."""
    notices, _ = part
    wait_until(lambda: notices.pace.parked == 1 and file_data(tree) is not None)
    assert notices.dump() == "notice keys absent (read at the tick) 1"
    asked = emulator.request_count
    emulator.announce(upcoming=SCHEDULED)
    assert notices.pace.parked == 1 and emulator.request_count == asked  # no read of its own
    notices.tick(None)
    wait_until(lambda: notices.status().state == "notice")
    assert notices.pace.parked == 0 and notices.dump() is None
    emulator.announce(upcoming={})  # gone again: its long-poll says so, then it waits for a tick
    wait_until(lambda: notices.status().state == "quiet" and notices.pace.parked == 1)


def test_the_tick_pace_ends_a_wait_at_the_first_tick_after_it_is_due_or_at_the_stop() -> None:
    from tpuboot.notices.watch import TickPace

    now, read = [100.0], [0]  # the clock, and how often the pace read it

    def clock() -> float:
        read[0] += 1
        return now[0]

    stop = threading.Event()
    pace = TickPace(stop, clock)
    ended: list[bool] = []
    waiter = threading.Thread(target=lambda: ended.append(pace.wait(30.0)))
    waiter.start()
    wait_until(lambda: pace.parked == 1)
    now[0] += 28.0  # before due (30 s less the slack of a tick come early)
    pace.tick()
    wait_until(lambda: read[0] == 2)  # woken, it looked at the clock
    assert pace.parked == 1 and not ended  # and waits on
    now[0] += 1.5  # 29.5 s: within the slack, so due
    pace.tick()
    waiter.join(10)
    assert ended == [False] and pace.parked == 0
    waiter = threading.Thread(target=lambda: ended.append(pace.wait(3600.0)))
    waiter.start()
    wait_until(lambda: pace.parked == 1)
    stop.set()
    pace.release()
    waiter.join(10)
    assert ended == [False, True]


def test_with_a_pace_an_absent_key_never_sleeps_on_a_timer_of_the_watch() -> None:
    """The watch's own waits (``stop.wait``) are for backoff only; an absent key's go to the pace."""
    from tpuboot.gce.failures import FailureLog
    from tpuboot.gce.replies import MetadataAbsent, Reply
    from tpuboot.gce.watch import watch

    timers: list[float] = []
    paced: list[float] = []

    class Recorded(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            timers.append(timeout or 0.0)
            return self.is_set()

    def pace(at_least: float) -> bool:
        paced.append(at_least)
        return len(paced) == 3  # stopped at the third

    def poll(etag: str | None) -> Reply:
        raise MetadataAbsent("absent")

    common = dict(
        etag=None, timeout_sec=60, failures=FailureLog(), min_poll_interval=1.0, aborted=lambda: False
    )
    changes = list(
        watch(
            poll, "u", stop=Recorded(), delay=lambda n: 0.5, absent_interval=30.0, absent_wait=pace, **common
        )  # type: ignore[arg-type]
    )
    assert changes == [Change(None, None)] and timers == []
    assert len(paced) == 3 and all(1.0 < w <= 30.0 for w in paced)


def test_an_absent_key_is_read_no_more_often_than_the_absent_interval() -> None:
    """The watch's own pacing, told through the wait it asks of ``stop`` (no clock in the test):
    a key the server lacks is read again after ``absent_interval``, a present one long-polled."""
    from tpuboot.gce.failures import FailureLog
    from tpuboot.gce.replies import MetadataAbsent, Reply
    from tpuboot.gce.watch import watch

    waits: list[float] = []

    class Recorded(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            if len(waits) == 3:
                self.set()
            return self.is_set()

    def poll(etag: str | None) -> Reply:
        raise MetadataAbsent("absent")

    stop = Recorded()
    common = dict(
        etag=None, timeout_sec=60, failures=FailureLog(), min_poll_interval=1.0, aborted=lambda: False
    )
    changes = list(watch(poll, "u", stop=stop, delay=lambda n: 0.5, absent_interval=30.0, **common))  # type: ignore[arg-type]
    assert changes == [Change(None, None)]  # said once
    # absent_interval less the poll's time, which load may stretch: above the 1 s that the other
    # terms (backoff 0.5 s, min_poll_interval 1 s) reach, so the interval set it.
    assert len(waits) == 3 and all(1.0 < w <= 30.0 for w in waits)
    waits.clear()
    stop = Recorded()
    list(watch(poll, "u", stop=stop, delay=lambda n: 0.5, **common))  # type: ignore[arg-type]
    assert all(w <= 1.0 for w in waits)  # without it: the backoff alone, as for tpu-env
