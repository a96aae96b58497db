"""Work on other processes that ends on time, whatever those processes do.

Reading another process's ``cmdline`` takes its memory map's lock, and stat'ing one of its open
files asks that file's filesystem: a process stuck in the kernel, or a FUSE file whose server
never answers, blocks either read for as long as it likes (the reason ``ps`` and ``fuser`` hang
on such hosts). Python cannot interrupt a blocked system call, so the work runs in a worker
thread and the caller waits for it: a worker that makes no progress for ``patience`` seconds is
left behind on the item it is stuck on, which is reported as not answered, and a new worker
takes the next item. A whole run ends by its ``budget``: items not reached by then are reported
too, never taken as seen.

A stuck worker cannot be ended, so it must not multiply: an item whose earlier worker is still
stuck is reported at once without a new read, and while :data:`MAX_STUCK` workers are stuck no
new worker starts (the daemon scans every 30 s, and a thread per scan would grow for days).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

#: Seconds a worker may spend on one item before it is left behind.
PATIENCE = 2.0
#: Seconds one run may take in all.
BUDGET = 10.0
#: Workers left behind that may be stuck at once, in this process.
MAX_STUCK = 4

_stuck_lock = threading.Lock()
_stuck: dict[Hashable, threading.Thread] = {}  # item -> the worker stuck on it


@dataclass
class Outcome(Generic[K, R]):
    """What a run got: each item's result, and the items it could not see."""

    results: dict[K, R] = field(default_factory=dict)
    unanswered: list[K] = field(default_factory=list)  # a read of it blocked (now or in an earlier run)
    not_reached: list[K] = field(default_factory=list)  # the budget ran out, or too many workers stuck

    @property
    def complete(self) -> bool:
        return not self.unanswered and not self.not_reached


class _Worker(threading.Thread, Generic[K, R]):
    """Does ``work`` on ``items[start:]`` in order; stops after its item once left behind."""

    def __init__(self, items: Sequence[K], work: Callable[[K], R], start: int) -> None:
        super().__init__(name="tpuboot-proc-reader", daemon=True)
        self.items = items
        self.work = work
        self.position = start  # the item being worked on (one assignment: read without the lock)
        self.results: dict[K, R] = {}
        self.done = threading.Event()
        self.left_behind = False

    def run(self) -> None:
        try:
            for index in range(self.position, len(self.items)):
                if self.left_behind:
                    break
                self.position = index
                self.results[self.items[index]] = self.work(self.items[index])
        finally:
            with _stuck_lock:  # it was stuck and came back: its item may be read again
                self.done.set()
                for key in [k for k, worker in _stuck.items() if worker is self]:
                    del _stuck[key]


def each_within(
    items: Sequence[K],
    work: Callable[[K], R],
    patience: float | None = None,
    budget: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome[K, R]:
    """``work`` on each of ``items`` (distinct), in a worker that is left behind when one item
    makes no progress for ``patience`` seconds (it is noticed within twice that); the run ends
    by ``budget`` seconds. ``work`` should not raise: an item it raised on is not reached."""
    patience = PATIENCE if patience is None else patience
    outcome: Outcome[K, R] = Outcome()
    end = clock() + (BUDGET if budget is None else budget)
    with _stuck_lock:
        outcome.unanswered += [item for item in items if item in _stuck]
    skipped = set(outcome.unanswered)
    todo = [item for item in items if item not in skipped]
    start = 0
    while start < len(todo):
        with _stuck_lock:
            crowded = len(_stuck) >= MAX_STUCK
        if crowded:
            break
        worker: _Worker[K, R] = _Worker(todo, work, start)
        worker.start()
        start = _watch(worker, outcome, patience, end, clock)
    seen = set(outcome.results) | set(outcome.unanswered)
    outcome.not_reached += [item for item in todo if item not in seen]
    return outcome


def _watch(
    worker: _Worker[K, R], outcome: Outcome[K, R], patience: float, end: float, clock: Callable[[], float]
) -> int:
    """Wait for ``worker``; the index to go on from (the end of its items when it finished or
    the budget ran out)."""
    last = worker.position
    while not worker.done.wait(max(0.0, min(patience, end - clock()))):
        position = worker.position
        if position != last and clock() < end:
            last = position
            continue
        with _stuck_lock:
            if worker.done.is_set():  # it finished just now
                break
            worker.left_behind = True
            _stuck[worker.items[position]] = worker
        outcome.results.update(dict(worker.results))
        if clock() >= end:
            return len(worker.items)
        outcome.unanswered.append(worker.items[position])
        return position + 1
    outcome.results.update(worker.results)
    return len(worker.items)
