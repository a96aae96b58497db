from tpuboot.backoff import CRASH_LOOP_EXITS, RestartPolicy
from tpuboot.config import SupervisorConfig


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
