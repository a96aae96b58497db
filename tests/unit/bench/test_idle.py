"""bench/idle.py's count of the process's wake-ups from the kernel's sched_wakeup events: a run of
its threads' wake-ups is one wake-up of the process, named by what woke it first."""

from __future__ import annotations

from bench.idle import EPISODE_GAP_S, wake_episodes

MAIN, POOL, WATCH, EMULATOR = 10, 11, 12, 99


def wakeup(t: float, tid: int, by: int = 0, irq: bool = False) -> dict[str, object]:
    return {"t": t, "tid": tid, "by": by, "irq": irq}


def test_a_tick_handed_to_the_pool_is_one_wake_up_and_a_long_poll_answer_another() -> None:
    tids = {MAIN, POOL, WATCH}
    wakeups = [
        wakeup(30.0, MAIN, irq=True),  # the watchdog's timer
        wakeup(30.001, POOL, by=MAIN),  # the loop hands the tick's round to the pool
        wakeup(30.004, MAIN, by=POOL),  # the GIL back
        wakeup(45.0, WATCH, by=EMULATOR),  # a long-poll's answer, sent by the emulator's process
        wakeup(60.0, MAIN, irq=True),
    ]
    episodes = wake_episodes(list(reversed(wakeups)), tids)  # in any order
    assert [(e["t"], e["tid"], e["cause"]) for e in episodes] == [
        (30.0, MAIN, "interrupt"),
        (45.0, WATCH, "process"),
        (60.0, MAIN, "interrupt"),
    ]


def test_a_longer_gap_starts_another_and_a_chain_of_short_gaps_does_not() -> None:
    step = EPISODE_GAP_S * 0.9
    chain = [wakeup(i * step, POOL, by=MAIN) for i in range(20)]  # far longer than the gap in all
    later = wakeup(chain[-1]["t"] + 2 * EPISODE_GAP_S, MAIN, by=POOL)  # type: ignore[operator]
    episodes = wake_episodes([*chain, later], {MAIN, POOL})
    assert [(e["tid"], e["cause"]) for e in episodes] == [(POOL, "own thread"), (MAIN, "own thread")]
    assert wake_episodes([], {MAIN}) == []
