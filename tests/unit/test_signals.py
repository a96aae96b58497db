"""Every signal systemd or a person may send `tpuboot run` has the meaning tpuboot/signals.py and
tpuboot(8) give it: none ends it without its stop, a second SIGTERM during the stop is logged and
ignored while the stop finishes, and a storm costs a line, not the journal.

`tpuboot run` runs in a subprocess as systemd starts it (tests/unit/helpers/runproc.py), so a signal with
no meaning ends that process, never the test run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.runproc import RunningDaemon, free_port, tpuboot_run
from tpuboot import signals

#: Signals that must leave the daemon running, each with what its line says (None: no line).
RUNS_ON = {
    signal.SIGHUP: "SIGHUP: tpuboot reads its configuration only at start; ignored",
    signal.SIGUSR1: "SIGUSR1: ready, tpuboot ",
    signal.SIGUSR2: "SIGUSR2: debug logging on",
    signal.SIGALRM: "SIGALRM: not used by tpuboot; ignored",
    signal.SIGVTALRM: "SIGVTALRM: not used by tpuboot; ignored",
    signal.SIGPROF: "SIGPROF: not used by tpuboot; ignored",
    signal.SIGIO: "SIGIO: not used by tpuboot; ignored",
    signal.SIGPWR: "SIGPWR: not used by tpuboot; ignored",
    signal.SIGQUIT: "SIGQUIT: thread MainThread:\n",  # then its stack, as each thread's
    signal.SIGPIPE: None,
}


@pytest.fixture
def run(tmp_path: Path, emulator: MetadataEmulator) -> Iterator[RunningDaemon]:
    """`tpuboot run` READY, tpu-env watched, guest attributes on (its stop writes state=stopped)."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    kernel = FakeKernel(tmp_path / "root")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    config = f"vbar: {{enabled: false}}\nmetrics: {{port: {free_port()}}}\nmetadata: {{watch: true}}\n"
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path) as daemon:
        daemon.receive("READY=1")
        wait_until(lambda: len(emulator.guest_attributes("tpuboot")) == 5, timeout=20)
        yield daemon


def test_the_table_covers_every_signal_that_ends_a_process_by_default() -> None:
    """What a person may send with kill(1) that would end it: each has a meaning here, or is
    caught by systemd's own semantics (TERM, INT: the stop)."""
    meant = {*signals.STOP, *signals.IGNORED, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT}
    assert signal.SIGQUIT in signals.HELD
    meant.add(signal.SIGPIPE)  # ignored by Python itself from the start
    sent_by_people = {"SIGHUP", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM",
                      "SIGVTALRM", "SIGPROF", "SIGIO", "SIGPWR"}  # fmt: skip
    assert {signal.Signals[name] for name in sent_by_people} <= meant
    assert signals.STOP_BUDGET < 10  # the unit's TimeoutStopSec=10


def test_each_signal_does_what_it_means_and_a_second_sigterm_does_not_cut_the_stop(
    run: RunningDaemon, emulator: MetadataEmulator
) -> None:
    for sig in RUNS_ON:
        run.process.send_signal(sig)
    for _ in range(300):  # a storm: a line for it (each QUIT reads every thread's stack: none crashes)
        run.process.send_signal(signal.SIGHUP)
        run.process.send_signal(signal.SIGQUIT)
    emulator.set_attribute("tpu-env", "WORKER_ID: '7'\n")  # the loop still answers a change
    run.receive("; tpu-env: 1 key from metadata", 30)
    assert run.process.poll() is None
    emulator.set_faults(delay=1.5)  # the stop's last guest-attribute write takes 1.5 s
    asked = emulator.request_count
    run.process.send_signal(signal.SIGTERM)
    run.receive("STOPPING=1", 20)
    assert emulator.wait_for_requests(asked + 1, timeout=20)  # that write has begun: mid-stop
    run.process.send_signal(signal.SIGTERM)
    run.process.send_signal(signal.SIGINT)
    run.process.wait(timeout=20)
    assert run.process.returncode == 0
    assert emulator.guest_attributes("tpuboot")["tpuboot/state"] == "stopped"  # the stop finished
    err = run_stderr(run)
    for line in filter(None, RUNS_ON.values()):
        assert line in err, line
    assert sum("SIGHUP:" in line for line in err.splitlines()) <= 2, err  # 301 of them: a line, or two
    assert "SIGTERM: stopping" in err
    assert "SIGTERM: already stopping; ignored (the stop ends within 8 s)" in err
    assert "SIGINT: already stopping; ignored" in err
    assert "Traceback" not in err


def run_stderr(daemon: RunningDaemon) -> str:
    """Its stderr, once it has ended (tpuboot_run reads it at the end of its block)."""
    out: str = daemon.process.communicate(timeout=10)[1] or ""
    daemon.stderr = out
    return out


def test_a_stop_signal_before_ready_still_stops_cleanly(tmp_path: Path, emulator: MetadataEmulator) -> None:
    """A metadata server that does not answer holds READY: SIGTERM then still means the stop."""
    emulator.set_faults(delay=30.0)
    kernel = FakeKernel(tmp_path / "root")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    config = "vbar: {enabled: false}\nmetrics: {enabled: false}\nmetadata: {boot_deadline: 60}\n"
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path) as daemon:
        wait_until(lambda: emulator.request_count >= 1, timeout=30)
        for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGALRM):
            os.kill(daemon.process.pid, sig)
        daemon.process.send_signal(signal.SIGTERM)
        seen = daemon.receive("STOPPING=1", 20)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0
    assert not any("READY=1" in message for message in seen)
    assert "SIGUSR1: starting" in daemon.stderr


def test_before_the_loop_the_held_signals_are_dropped_and_a_child_still_gets_their_default() -> None:
    """The first moments of `tpuboot run` (the coldplug binds, the imports): a SIGHUP there must not
    end it; and a child started later (vbar.runtime: exec) must not inherit it ignored."""
    import subprocess

    saved = {sig: signal.getsignal(sig) for sig in signals.HELD}
    try:
        signals.hold_until_served()
        for sig in signals.HELD:
            os.kill(os.getpid(), sig)  # each caught and dropped: this process goes on
        child = subprocess.run(["sh", "-c", "kill -HUP $$; echo survived"], capture_output=True, text=True)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert child.returncode == -signal.SIGHUP and child.stdout == ""
