import dataclasses
import random
import threading

import pytest

from tpuboot.backoff import CRASH_LOOP_EXITS, Backoff, RestartPolicy, restarted
from tpuboot.config import SupervisorConfig
from tpuboot.devices import manager


def test_delays_double_from_initial_up_to_the_cap() -> None:
    policy = RestartPolicy(initial=1.0, maximum=10.0, stable_after=60.0)
    assert [policy.delay_after(0.5) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_stable_run_resets_the_sequence() -> None:
    policy = RestartPolicy(initial=2.0, maximum=100.0, stable_after=60.0)
    assert [policy.delay_after(1.0) for _ in range(3)] == [2.0, 4.0, 8.0]
    assert policy.delay_after(60.0) == 2.0
    assert policy.delay_after(59.9) == 4.0


def test_crash_loop_after_several_short_runs_only() -> None:
    policy = RestartPolicy(initial=1.0, maximum=10.0, stable_after=60.0)
    for _ in range(CRASH_LOOP_EXITS - 1):
        policy.delay_after(0.1)
        assert not policy.crash_loop
    policy.delay_after(0.1)
    assert policy.crash_loop
    policy.delay_after(120.0)
    assert not policy.crash_loop
    policy.reset()
    assert policy.exits == 0


def test_many_exits_do_not_overflow() -> None:
    policy = RestartPolicy(initial=1.0, maximum=300.0, stable_after=600.0)
    for _ in range(2000):
        delay = policy.delay_after(0.0)
    assert delay == 300.0


def test_from_config_uses_the_supervisor_section() -> None:
    policy = RestartPolicy.from_config(
        SupervisorConfig(backoff_initial=0.5, backoff_max=4.0, stable_after=9.0)
    )
    assert (policy.initial, policy.maximum, policy.stable_after) == (0.5, 4.0, 9.0)


# --- the one policy: every retry in tpuboot waits by Backoff ---------------------------------------


def test_backoff_ceiling_doubles_from_initial_to_the_maximum_without_overflow() -> None:
    policy = Backoff(initial=0.5, maximum=4.0, floor=0.0)
    assert [policy.ceiling(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.ceiling(10_000) == 4.0  # 2.0 ** 10000 would overflow: the exponent is capped first
    assert policy.ceiling(-1) == 0.5  # no attempt before the first


def test_backoff_delay_is_the_floor_plus_full_jitter_under_the_ceiling() -> None:
    policy = Backoff(initial=1.0, maximum=8.0, floor=0.5)
    rng = random.Random(7)
    for attempt in range(6):
        delays = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0.5 <= d <= 0.5 + policy.ceiling(attempt) for d in delays)
        assert max(delays) - min(delays) > policy.ceiling(attempt) / 2  # spread, not lockstep


@pytest.mark.parametrize("failures", [1, 2, 3, 6, 7, 40, 5000])
def test_a_binds_retry_and_a_restart_wait_by_the_same_ceiling(failures: int) -> None:
    """tpuboot/devices/manager.py and RestartPolicy (containers, the tpu-env watch) are that policy."""
    bind = Backoff(manager.BACKOFF_FIRST, manager.BACKOFF_CAP, floor=0.0)
    assert manager.retry_delay(failures) == bind.ceiling(failures - 1)
    restart = RestartPolicy(initial=1.0, maximum=300.0, stable_after=600.0)
    delays = [restart.delay_after(0.0) for _ in range(failures)]
    assert delays[-1] == Backoff(1.0, 300.0, floor=0.0).ceiling(failures - 1)


def test_from_config_reads_any_section_with_the_three_settings() -> None:
    """backoff.py imports no config (the metadata client uses it, and the config's validators use
    the client's neighbours): the supervisor section is read by its fields."""

    @dataclasses.dataclass
    class Section:
        backoff_initial: float = 2.0
        backoff_max: float = 16.0
        stable_after: float = 30.0

    policy = RestartPolicy.from_config(Section())
    assert [policy.delay_after(1.0) for _ in range(5)] == [2.0, 4.0, 8.0, 16.0, 16.0]


def test_a_watch_outlives_its_bugs_and_a_change_ends_the_streak():
    """Each bug is told with its doubling wait and whether it opens a streak; a change handled
    (``progressed``) ends the streak; the watch returning ends the loop."""
    stop = threading.Event()
    script = iter(["bug", "bug", "change", "bug", "return"])
    told: list[tuple[str, float, bool]] = []

    def watch(progressed):
        for step in script:
            if step == "bug":
                raise ValueError(step)
            if step == "change":
                progressed()
            else:
                return

    restarted(watch, stop, lambda exc, delay, first: told.append((str(exc), delay, first)), (0.001, 0.002))
    assert told == [("bug", 0.001, True), ("bug", 0.002, False), ("bug", 0.001, True)]


def test_a_bug_once_stop_is_set_is_the_shutdown_not_a_bug():
    stop = threading.Event()
    told = []

    def watch(progressed):
        stop.set()
        raise ConnectionError("closed under the watch")

    restarted(watch, stop, lambda *args: told.append(args))
    assert told == []
