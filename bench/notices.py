"""Notices: from a notice at the metadata emulator to the first hook's start, and the idle cost
of the three watches, on loopback (unit level, no guest).

Latency: the notice part (tpuboot/notices/service.py) watches the emulator on 127.0.0.1 with the
daemon's long-poll (``timeout_sec`` 60); each round the emulator announces
TERMINATE_ON_HOST_MAINTENANCE and, once the hook ran, NONE again (the bench sets the part's
REPEAT_AFTER to 0, so each round's notice runs the hooks: a daemon runs them once per 10 min for
the same notice), and the bench times, from the announce (made once the long-polls wait, as on
a host where the last change is long past), (a) the hook runner about to start the first hook
and (b) the hook's own first line running (it writes its clock). ``--rounds`` rounds; medians, worst, and the
ratio to the ~30 s a preemption leaves. Goal: under 1 s.

Idle cost: with nothing changing for ``--idle-seconds`` (60), the part ticked every 30 s as the
daemon's watchdog beat ticks it (the absent ``upcoming-maintenance`` is read at a tick), the
requests the emulator saw and the voluntary context switches of the part's threads (each a
wake-up; /proc/self/task/TID/status), per minute. Goal: one long-poll per present key per
``timeout_sec``, one read of an absent key per tick, and no wake-up beyond them.

    .venv/bin/python -m bench.notices [--rounds 20] [--idle-seconds 60]

Benchmarks print figures; they are not assertions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from harness.mds_emulator import MetadataEmulator
from tpuboot.gce.client import MetadataClient
from tpuboot.notices import service
from tpuboot.notices.hooks import HOOKS_DIR
from tpuboot.notices.service import Notices, NoticeSettings
from tpuboot.paths import Root

PREEMPTION_NOTICE_S = 30.0
#: The daemon's tick with systemd's watchdog of the shipped unit (WatchdogSec=1min: a beat every 30 s).
TICK_S = 30.0


def switches(tid: int) -> int:
    """A thread's voluntary context switches so far (each one a sleep it woke from)."""
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.notices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.getLogger("tpuboot").setLevel(logging.ERROR)  # the notices' own lines: figures only here
    with tempfile.TemporaryDirectory() as top, MetadataEmulator() as emulator:
        root = Root(top)
        hooks = root.path(HOOKS_DIR)
        hooks.mkdir(parents=True)
        os.chmod(hooks, 0o755)
        stamps = Path(top) / "stamps"
        hook = hooks / "10-checkpoint"
        hook.write_text(f'#!/bin/sh\necho "$(date +%s.%N)" >> {stamps}\n')
        os.chmod(hook, 0o755)
        started: list[float] = []
        seen = threading.Condition()

        def hook_started(name: str) -> None:
            with seen:
                started.append(time.time())
                seen.notify_all()

        service.REPEAT_AFTER = 0.0  # every round's notice runs the hook (see above)
        client = MetadataClient(emulator.url, timeout=5.0)
        part = Notices(root, client, NoticeSettings(hook_deadline=25.0), hook_started=hook_started)
        part.start(lambda: None)
        try:
            assert emulator.wait_for_pollers(2, timeout=30), "the long-polls did not start"
            to_runner, to_hook = [], []
            for n in range(args.rounds):
                emulator.wait_for_pollers(2, timeout=30)  # after the last round's backoff
                announced = time.time()
                emulator.announce(maintenance="TERMINATE_ON_HOST_MAINTENANCE")
                with seen:
                    seen.wait_for(lambda n=n: len(started) > n, timeout=30)
                deadline = time.monotonic() + 30
                while (
                    not stamps.exists() or len(stamps.read_text().split()) <= n
                ) and time.monotonic() < deadline:
                    time.sleep(0.005)  # the bench waits for the hook's line; the figure is its stamp
                to_runner.append(started[n] - announced)
                to_hook.append(float(stamps.read_text().split()[n]) - announced)
                emulator.announce(maintenance="NONE")
                while part.status().state != "quiet" and time.monotonic() < deadline:
                    time.sleep(0.005)
            tids = [t.native_id for t in part._threads if t.native_id is not None]
            before_requests = emulator.request_count
            before = {tid: switches(tid) for tid in tids}
            for _ in range(int(args.idle_seconds // TICK_S)):  # the daemon's ticks, at its pace
                part.tick(None)
                time.sleep(TICK_S)
            time.sleep(args.idle_seconds % TICK_S)
            requests = emulator.request_count - before_requests
            woke = sum(switches(tid) - before[tid] for tid in tids)
        finally:
            part.stop()
            client.close()
    per_minute = 60.0 / args.idle_seconds
    report = {
        "rounds": args.rounds,
        "announce_to_runner_median_s": statistics.median(to_runner),
        "announce_to_hook_median_s": statistics.median(to_hook),
        "announce_to_hook_max_s": max(to_hook),
        "ratio_to_30s_notice": statistics.median(to_hook) / PREEMPTION_NOTICE_S,
        "idle_requests_per_minute": requests * per_minute,
        "idle_thread_wakeups_per_minute": woke * per_minute,
        "threads": len(tids),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
