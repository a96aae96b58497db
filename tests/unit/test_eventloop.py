"""The daemon's event loop (tpuboot/eventloop.py): timers, readers, wake-ups from threads and
signals, a raising callback contained, and no wake-up that nothing asked for."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.unit.helpers.eventloop import CountingSelector
from tpuboot.eventloop import EventLoop

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def loop():
    loop = EventLoop()
    yield loop
    loop.close()


def test_timers_run_in_the_order_they_are_due_and_a_cancelled_one_never(loop):
    ran: list[str] = []
    started = time.monotonic()  # before the timers are set: a pause after them cannot fail the bound
    loop.call_later(0.06, ran.append, "third")
    loop.call_later(0.02, ran.append, "first")
    cancelled = loop.call_later(0.04, ran.append, "cancelled")
    loop.call_later(0.04, ran.append, "second")
    loop.call_later(0.06, ran.append, "fourth")  # due with "third": after it, as set
    cancelled.cancel()
    loop.run_until(lambda: len(ran) == 4)
    assert ran == ["first", "second", "third", "fourth"]
    assert time.monotonic() - started >= 0.06  # none ran early


def test_a_timer_set_by_a_timer_runs_too(loop):
    ran: list[int] = []

    def again(n: int) -> None:
        ran.append(n)
        if n < 3:
            loop.call_later(0, again, n + 1)

    loop.call_later(0, again, 1)
    loop.run_until(lambda: len(ran) == 3)
    assert ran == [1, 2, 3]


def test_a_reader_is_called_when_its_fd_is_readable_and_not_after_removal(loop):
    rx, tx = socket.socketpair()
    rx.setblocking(False)
    got: list[bytes] = []
    loop.add_reader(rx.fileno(), lambda: got.append(rx.recv(16)))
    tx.send(b"one")
    loop.run_until(lambda: got == [b"one"])
    assert loop.remove_reader(rx.fileno()) and not loop.remove_reader(rx.fileno())
    tx.send(b"two")
    loop.call_later(0.05, loop.stop)  # a round in which rx is readable but no longer watched
    loop.run_until()
    assert got == [b"one"] and rx.recv(16) == b"two"
    rx.close()
    tx.close()


def test_a_thread_wakes_the_sleeping_loop(loop):
    ran: list[tuple[str, int]] = []
    blocked = threading.Event()

    def from_thread() -> None:
        blocked.wait(10)
        for i in range(100):
            loop.call_soon_threadsafe(lambda i=i: ran.append((threading.current_thread().name, i)))

    loop.call_later(0, blocked.set)  # the loop then sleeps with no timer at all
    worker = threading.Thread(target=from_thread, name="worker")
    worker.start()
    loop.run_until(lambda: len(ran) == 100)
    worker.join()
    assert ran == [(threading.current_thread().name, i) for i in range(100)]  # on the loop, in order


def test_stop_from_another_thread_ends_run_until_and_every_later_one(loop):
    threading.Timer(0.05, loop.stop).start()
    loop.run_until()  # no timer, no reader: only the stop can end it
    assert loop.stopping
    loop.run_until()  # returns at once


def test_a_raising_callback_is_logged_and_the_loop_goes_on(loop, caplog):
    ran: list[str] = []

    def broken() -> None:
        raise KeyError("a bug")

    loop.call_later(0, broken)
    loop.call_soon_threadsafe(broken)
    rx, tx = socket.socketpair()
    loop.add_reader(rx.fileno(), broken)  # raises each round, and the loop still serves the rest
    tx.send(b"x")
    loop.call_later(0.02, ran.append, "after")
    with caplog.at_level(logging.ERROR, logger="tpuboot.eventloop"):
        loop.run_until(lambda: ran == ["after"])
    loop.remove_reader(rx.fileno())
    rx.close()
    tx.close()
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) >= 3 and all(r.exc_info[0] is KeyError for r in failures)  # type: ignore[index]
    assert "unexpected error in test_a_raising_callback_is_logged_and_the_loop_goes_on.<locals>.broken" in (
        failures[0].getMessage()
    )


def test_sigterm_stops_the_loop_and_close_puts_the_old_handler_back(loop):
    before = signal.getsignal(signal.SIGTERM)
    fd_before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd_before)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    loop.run_until()  # nothing else would end it
    assert loop.stopping and time.monotonic() - started < 10
    loop.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(fd_before) == fd_before  # the wake-up fd given back too


def test_a_signal_before_the_loop_runs_is_not_lost(loop):
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    os.kill(os.getpid(), signal.SIGTERM)  # handled by the time os.kill returns: before any select
    loop.run_until()
    assert loop.stopping


def test_an_idle_loop_wakes_only_for_its_timer():
    """The watchdog's shape: one timer set again each time; over the idle time the selector
    returns once per tick (and a cancelled timer never wakes it)."""
    selector = CountingSelector()
    idle = EventLoop(selector)
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) < 5:
            idle.call_later(0.05, tick)

    idle.call_later(0.02, lambda: None).cancel()
    idle.call_later(0.05, tick)
    idle.run_until(lambda: len(ticks) == 5)
    idle.close()
    assert selector.wakeups == 5  # one per tick: no spin, no poll, no wake-up for the cancelled one


def test_a_flood_of_wakeups_never_crowds_out_a_signal(loop):
    """70,000 calls from a thread while the loop is busy: the wake-ups share one byte of the pipe,
    so the pipe (64 KiB) keeps room for SIGTERM's byte, and the loop still stops."""
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    ran: list[int] = []
    lost: list[str] = []

    def flood() -> None:
        for i in range(70_000):
            loop.call_soon_threadsafe(ran.append, i)

    def busy() -> None:  # the loop is held here while the thread calls
        worker = threading.Thread(target=flood)
        worker.start()
        worker.join()
        os.kill(os.getpid(), signal.SIGTERM)

    loop.call_later(0, busy)
    loop.call_later(20, lambda: (lost.append("SIGTERM never reached the loop"), loop.stop()))
    loop.run_until()
    assert lost == [] and ran == list(range(70_000))


def test_calls_after_close_are_dropped_without_error():
    loop = EventLoop()
    loop.close()
    loop.call_soon_threadsafe(print, "never")
    loop.stop()


def test_nothing_in_tpuboot_imports_asyncio():
    """Every tpuboot module imported in one fresh interpreter: asyncio is not among what they load
    (29 modules, resident for the daemon's whole life, for what tpuboot/eventloop.py does; issue 15)."""
    script = (
        "import importlib, pkgutil, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import tpuboot\n"
        "for m in pkgutil.walk_packages(tpuboot.__path__, 'tpuboot.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(len([n for n in sys.modules if n.startswith('tpuboot.')]), 'asyncio' in sys.modules)\n"
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, env=env,
                          timeout=120, check=True)  # fmt: skip
    count, asyncio_loaded = done.stdout.split()
    assert int(count) > 40 and asyncio_loaded == "False"


def test_every_call_from_a_thread_is_run_however_it_meets_the_drain(loop):
    """A wake-up written while the loop drains the pipe (and read in that same drain) must not leave
    the loop believing one is still pending: later calls would then write none, and the loop would
    sleep on them for good (seen: a daemon that did not stop when asked)."""
    total = 0
    ran = 0

    def count() -> None:
        nonlocal ran
        ran += 1

    def burst(n: int) -> None:
        for _ in range(n):
            loop.call_soon_threadsafe(count)
            time.sleep(0)  # let the loop in between: some calls land during its drain

    for _ in range(300):
        worker = threading.Thread(target=burst, args=(20,))
        total += 20
        guard = loop.call_later(10.0, loop.stop)  # a timer: it ends the round even if no wake-up comes
        worker.start()
        loop.run_until(lambda total=total: ran == total)  # no reader, no other timer: wake-ups end each round
        guard.cancel()
        worker.join()
        assert not loop.stopping, f"calls were left unrun: {ran} of {total}"


def test_the_do_nothing_callable_is_defined_once():
    """eventloop.nothing is every component's unheard report and the loop's wake-up: no module
    defines another function that does nothing (a docstring alone counts as nothing)."""
    import ast

    tpuboot = Path(__file__).resolve().parents[2] / "tpuboot"
    found = set()
    for path in sorted(tpuboot.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                body = [
                    s
                    for s in node.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                ]
                if all(isinstance(s, ast.Pass) for s in body):
                    found.add((str(path.relative_to(tpuboot)), node.name))
    assert found == {("eventloop.py", "nothing"), ("eventloop.py", "_on_signal")}
