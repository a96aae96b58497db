"""An executor whose jobs run when the test says: what a busy worker pool looks like."""

from __future__ import annotations

from concurrent.futures import Future


class Pool:
    """Holds each submitted job until :meth:`run_one` runs the oldest."""

    def __init__(self) -> None:
        self.jobs: list[tuple[object, Future]] = []

    def submit(self, fn, *args):  # type: ignore[no-untyped-def]
        future: Future = Future()
        self.jobs.append((lambda: fn(*args), future))
        return future

    def run_one(self) -> None:
        fn, future = self.jobs.pop(0)
        future.set_result(fn())  # type: ignore[operator]
