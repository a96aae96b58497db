"""A daemon part is one module and one line in the composition root (tpuboot/component.py).

A stand-in part, added to the list tpuboot.wiring.build assembles (as its one line there would add
it), is started with a report, holds READY while pending, shows its line in STATUS, observes, is
ticked in the pool and stopped, all with no change to tpuboot/daemon.py, which knows no part by
name. A stand-in after-boot part (one line in wiring's ``after_boot``) is made, started and shown
only once READY=1 went out, after the boot parts, and never when a stop came first.
"""

from __future__ import annotations

import logging
import threading

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import DEVICES_ONLY, make, on_loop, serving, until
from tests.unit.helpers.devices import add_tpu
from tpuboot import daemon as daemon_module
from tpuboot.component import PENDING, Part, Report, Status
from tpuboot.config import RuntimeMetricsConfig
from tpuboot.devices.snapshot import DeviceSnapshot
from tpuboot.eventloop import nothing


class Probe(Part):
    """A part that records what the daemon asks of it, and from which thread."""

    def __init__(self, name: str = "probe", periodic: bool = True, line: bool = True) -> None:
        self.name = name
        self._periodic = periodic
        self._status: Status | None = Status(PENDING, f"{name}: pending") if line else None
        self._report: Report = nothing
        self.calls: list[str] = []
        self.observed: list[bool] = []
        self.tick_threads: list[int] = []

    @property
    def periodic(self) -> bool:
        return self._periodic

    def start(self, report: Report) -> None:
        self.calls.append("start")
        self._report = report

    def status(self) -> Status | None:
        return self._status

    def set(self, status: Status) -> None:
        """As the part's own thread would: a new Status, then the report."""
        self._status = status
        self._report()

    def observe(self, ready: bool) -> None:
        self.observed.append(ready)

    def tick(self, devices: DeviceSnapshot) -> None:
        self.tick_threads.append(threading.get_ident())

    def stop(self) -> None:
        self.calls.append("stop")

    def dump(self) -> str:
        return f"{self.name} dumped"


#: The device side only, and no part there with tick work (the runtime collector's is on by default).
NO_TICK_WORK = DEVICES_ONLY.replace(runtime_metrics=RuntimeMetricsConfig(enabled=False))


@pytest.fixture
def kernel(tmp_path):
    k = FakeKernel(tmp_path)
    add_tpu(k)
    return k


def test_a_part_in_the_list_is_started_shown_ticked_and_stopped(kernel, monkeypatch, caplog):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a tick every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon, _, notifier = make(kernel)
    probe = Probe()
    daemon.parts.append(probe)  # the one line in tpuboot/wiring.py
    with caplog.at_level(logging.INFO, logger="tpuboot"), serving(daemon) as running:
        until(lambda: probe.calls == ["start"] and on_loop(daemon, daemon.devices.booted))
        on_loop(daemon, nothing)  # a round of the loop after the devices' last: READY would be out
        assert not daemon.ready and not any(m.startswith("READY=1") for m in notifier.sent)
        probe.set(Status("fine", "probe: fine"))
        until(lambda: daemon.ready)
        ready = next(m for m in notifier.sent if m.startswith("READY=1"))
        assert ready == "READY=1\nSTATUS=1 TPU bound to vfio-pci; probe: fine"
        until(lambda: True in probe.observed)  # READY and every report after it
        assert set(probe.observed) == {False, True}
        probe.set(Status("fine", "probe: still fine"))
        until(lambda: notifier.last_status == "1 TPU bound to vfio-pci; probe: still fine")
        until(lambda: len(probe.tick_threads) >= 2)
        assert running.thread.ident not in probe.tick_threads  # in the pool, never on the loop
        on_loop(daemon, daemon.dump_state)
        assert "SIGUSR1: fine: probe: still fine" in caplog.text
        assert "KiB, probe dumped" in caplog.text  # its own words in the dump's last line
        assert running.stop() == 0
    assert probe.calls == ["start", "stop"]
    # The watchdog beats on through the stop (the loop runs on): nothing else follows STOPPING=1.
    after = notifier.sent[notifier.sent.index("STOPPING=1\nSTATUS=stopping") + 1 :]
    assert set(after) <= {"WATCHDOG=1"}


def test_a_part_with_no_line_and_no_tick_work_adds_neither(kernel, monkeypatch):
    """No watchdog, no part with tick work: the daemon never ticks (an idle daemon sleeps)."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    daemon, _, notifier = make(kernel, config=NO_TICK_WORK)
    quiet = Probe("quiet", periodic=False, line=False)
    daemon.parts.append(quiet)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=1 TPU bound to vfio-pci"
        assert daemon._tick_timer is None
        assert running.stop() == 0
    assert quiet.calls == ["start", "stop"] and quiet.tick_threads == []


@pytest.mark.parametrize("when", ["boot", "after boot"])
def test_a_part_with_tick_work_makes_the_daemon_tick_without_a_watchdog(kernel, monkeypatch, when):
    """At start for a boot part; for an after-boot part, the tick is armed once it starts."""
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(daemon_module, "TICK_INTERVAL", 0.05)
    daemon, _, notifier = make(kernel, config=NO_TICK_WORK)
    probe = Probe(line=False)
    if when == "boot":
        daemon.parts.append(probe)
    else:
        daemon.after_boot = lambda: [probe]
    with serving(daemon) as running:
        until(lambda: len(probe.tick_threads) >= 3)
        assert "WATCHDOG=1" not in notifier.sent
        assert running.stop() == 0


def test_an_after_boot_part_is_made_started_and_shown_only_once_ready_went_out(kernel, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a tick every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon, _, notifier = make(kernel, config=NO_TICK_WORK)
    boot, late = Probe("boot"), Probe("late")
    late.set(Status("fine", "late: fine"))  # as made: no report until started
    made: list[bool] = []  # whether READY=1 had gone out when the factory ran

    def after_boot() -> list[Part]:
        made.append(any(m.startswith("READY=1") for m in notifier.sent))
        return [late]

    daemon.parts.append(boot)
    daemon.after_boot = after_boot
    with serving(daemon) as running:
        until(lambda: boot.calls == ["start"])
        on_loop(daemon, nothing)
        assert made == [] and late.calls == []  # READY waits for the pending boot part: nothing made
        boot.set(Status("fine", "boot: fine"))
        until(lambda: late.calls == ["start"])
        assert made == [True]
        ready = next(m for m in notifier.sent if m.startswith("READY=1"))
        assert ready == "READY=1\nSTATUS=1 TPU bound to vfio-pci; boot: fine"  # the boot parts only
        until(lambda: notifier.last_status == "1 TPU bound to vfio-pci; boot: fine; late: fine")
        until(lambda: len(late.tick_threads) >= 2)
        assert late.observed and set(late.observed) == {True}  # from READY on
        assert daemon.parts[-1] is late  # after the boot parts: STATUS's order and the stop's
        assert running.stop() == 0
    assert boot.calls == late.calls == ["start", "stop"]


def test_a_stop_before_ready_never_makes_the_after_boot_parts(kernel):
    daemon, _, notifier = make(kernel, config=NO_TICK_WORK)
    boot, late = Probe("boot"), Probe("late")  # boot: pending, so READY waits for it
    made: list[Part] = []

    def after_boot() -> list[Part]:
        made.append(late)
        return [late]

    daemon.parts.append(boot)
    daemon.after_boot = after_boot
    with serving(daemon) as running:
        until(lambda: boot.calls == ["start"])
        assert running.stop() == 0
    assert not any(m.startswith("READY=1") for m in notifier.sent)
    assert made == [] and late not in daemon.parts and late.calls == []  # never made, started, stopped
    assert boot.calls == ["start", "stop"]


class Broken(Probe):
    def tick(self, devices: DeviceSnapshot) -> None:
        raise RuntimeError("a bug in a tick")


def test_a_bug_in_one_parts_tick_is_logged_and_the_others_still_tick(kernel, caplog):
    daemon, _, _ = make(kernel)
    broken, after = Broken("broken"), Probe("after")
    daemon.parts += [broken, after]
    try:
        with caplog.at_level(logging.ERROR, logger="tpuboot.daemon"):
            daemon._periodic_work()  # one round, as the pool runs it
    finally:
        daemon.executor.shutdown()
        daemon.loop.close()
    assert len(after.tick_threads) == 1
    (record,) = caplog.records
    assert record.getMessage() == "periodic check broken failed; please report it" and record.exc_info


def test_the_stop_closes_the_metadata_client_between_its_two_rounds(kernel):
    """The list's order, the parts that stop after the metadata client once it is closed."""
    stopped: list[str] = []

    class Stopping(Probe):
        def stop(self) -> None:
            stopped.append(self.name)

    class Late(Stopping):
        stops_after_metadata = True

    class Client:
        def close(self) -> None:
            stopped.append("metadata client")

    daemon, _, _ = make(kernel)
    daemon.parts = [Stopping("first"), Late("late"), Stopping("second")]
    daemon.metadata = Client()  # type: ignore[assignment]
    try:
        daemon._stop_parts()
    finally:
        daemon.loop.close()
    assert stopped == ["first", "second", "metadata client", "late"]
