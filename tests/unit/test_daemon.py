"""The daemon's loop on a temporary tree: coldplug before READY, hotplug, removal, retries, SIGTERM.

Each daemon here is built by tpuboot.wiring.build, as `tpuboot run` builds it, with a fake kernel's
binder, a udev monitor and a notifier the test holds, and a metadata client for the emulator. It
serves in a thread of its own (:func:`serving`), or on the main thread where SIGTERM is the point
(:func:`serve_here`); the test waits for conditions (:func:`until`), never for a fixed time, so
the tests hold on a loaded machine.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import (
    DEVICES_ONLY,
    FIRST_ATTEMPT,
    Event,
    QueueMonitor,
    RecordingNotifier,
    after_boot_part,
    make,
    serving,
    until,
    with_env,
)
from tests.unit.helpers.devices import V5P, add_tpu, binder, four_tpus_and_a_disk
from tests.unit.helpers.metadata import make_client, make_config
from tests.unit.helpers.runproc import free_port
from tpuboot import bootbudget, cli
from tpuboot.bootbudget import BootBudget
from tpuboot.component import Status
from tpuboot.config import (
    GuestAttributesConfig,
    MetricsConfig,
    ReadyConfig,
    VbarConfig,
)
from tpuboot.containers.service import Containers
from tpuboot.daemon import Daemon
from tpuboot.derived import GuestAttributes
from tpuboot.devices import manager
from tpuboot.env import service as envservice
from tpuboot.env import sync as envsync
from tpuboot.env.results import Bugs, SyncResult
from tpuboot.env.service import EnvService
from tpuboot.env.sync import EnvSync
from tpuboot.env.watch import watch_tpu_env
from tpuboot.errors import MetadataError
from tpuboot.gce.replies import Change
from tpuboot.metrics_endpoint import MetricsEndpoint
from tpuboot.wiring import build


def serve_here(daemon: Daemon, drive: Callable[[Daemon], None], within: float = 20.0) -> int:
    """``daemon.serve()`` on this, the main, thread as `tpuboot run` runs it (SIGTERM and SIGINT
    handled), while ``drive(daemon)`` runs in a thread. The daemon must return within ``within``
    seconds of the driver's end; if it does not, or the driver fails, it is stopped by request and
    the test fails."""
    failures: list[BaseException] = []
    returned = threading.Event()

    def driver() -> None:
        try:
            drive(daemon)
        except BaseException as exc:
            failures.append(exc)
            daemon.request_stop()
            return
        if not returned.wait(within):
            failures.append(AssertionError(f"the daemon was still serving {within} s after the driver ended"))
            daemon.request_stop()

    thread = threading.Thread(target=driver, name="driver", daemon=True)
    thread.start()
    try:
        code = daemon.serve()
    finally:
        returned.set()
        thread.join(20)
    if failures:
        raise failures[0]
    return code


@pytest.fixture
def kernel(tmp_path):
    return four_tpus_and_a_disk(FakeKernel(tmp_path))


def test_coldplug_binds_every_tpu_before_ready_and_leaves_others(kernel):
    daemon, _, notifier = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert [kernel.driver(f"0000:00:0{4 + i}.0") for i in range(4)] == ["vfio-pci"] * 4
        assert notifier.sent[0] == "READY=1\nSTATUS=4 TPUs bound to vfio-pci"
        assert running.stop() == 0
        assert notifier.sent[-1].startswith("STOPPING=1")
    assert kernel.driver("0000:00:02.0") == "virtio-pci"


def test_hotplug_add_is_bound_and_remove_is_logged(kernel, caplog):
    caplog.set_level("INFO", logger="tpuboot")
    daemon, monitor, notifier = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        add_tpu(kernel, "0000:00:0a.0", V5P, group="10")
        monitor.push("add", "pci", "0000:00:0a.0")
        until(lambda: kernel.driver("0000:00:0a.0") == "vfio-pci")
        until(lambda: notifier.last_status == "5 TPUs bound to vfio-pci")
        kernel.remove_device("0000:00:0a.0")
        monitor.push("remove", "pci", "0000:00:0a.0")
        until(lambda: notifier.last_status == "4 TPUs bound to vfio-pci")
        running.stop()
    assert "0000:00:0a.0 (TPU v5p) removed" in caplog.text


def test_one_failing_device_does_not_stop_the_others_and_is_retried(kernel, monkeypatch):
    monkeypatch.setattr(
        manager, "BACKOFF_FIRST", 0.2
    )  # five retries over 6 s: the test clears the cause well within
    kernel.refuse_probe.add("0000:00:05.0")
    daemon, _, notifier = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        expected = "3 of 4 TPUs bound to vfio-pci; 0000:00:05.0: vfio-pci did not"
        assert notifier.last_status.startswith(expected)
        kernel.refuse_probe.clear()  # the transient cause goes away
        until(lambda: notifier.last_status == "4 TPUs bound to vfio-pci")
        running.stop()


def test_permanent_failure_is_not_retried(kernel, tmp_path):
    noiommu = FakeKernel(tmp_path / "noiommu")
    add_tpu(noiommu, "0000:00:04.0", V5P, driver=None, group=None)
    daemon, _, notifier = make(noiommu)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert "0 of 1 TPU bound to vfio-pci; 0000:00:04.0: no IOMMU group" in notifier.last_status
        assert daemon.devices.devices["0000:00:04.0"].retry is None
        running.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_cleanly(kernel, sig):
    daemon, _, notifier = make(kernel)

    def drive(daemon: Daemon) -> None:
        until(lambda: daemon.ready)
        os.kill(os.getpid(), sig)

    before = signal.getsignal(sig)
    assert serve_here(daemon, drive, within=10.0) == 0
    assert notifier.sent[-1].startswith("STOPPING=1")
    assert signal.getsignal(sig) is before  # given back when the daemon ended


class FailingNotifier(RecordingNotifier):
    """sd_notify failing ``failures`` times (no fd to spare, systemd busy), then working again."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def _send(self, text: str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        super()._send(text)


def test_a_failed_watchdog_send_never_ends_the_watchdog(kernel, monkeypatch):
    """Before: WATCHDOG=1 was re-armed only after a send that worked, so one failure ended it."""
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = FailingNotifier(failures=3)
    config = DEVICES_ONLY.replace(ready=FIRST_ATTEMPT)
    daemon = build(kernel.root, config, binder=binder(kernel), monitor=QueueMonitor(), notifier=notifier)
    with serving(daemon) as running:
        until(lambda: notifier.failures == 0 and notifier.sent.count("WATCHDOG=1") >= 5)
        assert any(m.startswith("READY=1") for m in notifier.sent)  # READY came, if late
        assert running.stop() == 0


def test_a_stop_that_hangs_is_cut_at_the_stop_budget_and_the_watchdog_beats_meanwhile(
    kernel, emulator, root, monkeypatch, caplog
):
    """Every wait at stop has a bound, and together they have one: STOP_BUDGET, under the unit's
    TimeoutStopSec, so tpuboot ends by itself before systemd would SIGKILL it."""
    from tpuboot import signals

    monkeypatch.setattr(signals, "STOP_BUDGET", 1.0)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon, _, notifier = make(kernel, config=with_env(emulator), root=root, metadata=make_client(emulator))
    env = daemon.part(EnvService)
    assert env is not None
    released = threading.Event()
    monkeypatch.setattr(env, "stop", lambda: released.wait(60))  # a stop that never returns
    with caplog.at_level("ERROR", logger="tpuboot.daemon"), serving(daemon) as running:
        until(lambda: daemon.ready)
        daemon.request_stop()
        stopping = "STOPPING=1\nSTATUS=stopping"
        until(lambda: stopping in notifier.sent)
        after = notifier.sent.index(stopping)
        until(lambda: "WATCHDOG=1" in notifier.sent[after:])  # the loop runs on during the stop
        assert running.stop() == 0  # within the budget, not the 60 s
    released.set()
    assert "stop: still not finished after 1 s; exiting all the same" in caplog.text


def test_a_modprobe_that_runs_out_of_time_at_boot_is_retried_not_given_up(kernel, monkeypatch):
    """Found by the long-life soak: on a loaded machine `modprobe vfio-pci` outlived its 30 s at
    boot, the cold-plugged TPUs were failed for good, and stayed unbound for the daemon's whole
    life (a restart used to hide it). A timeout is transient: the bind is retried."""
    from tpuboot.errors import TimedOut

    monkeypatch.setattr(manager, "BACKOFF_FIRST", 0.01)
    b = binder(kernel)
    load = b.load_module
    slow = [1]

    def modprobe(name: str) -> None:
        if name == "vfio-pci" and slow:
            slow.pop()
            raise TimedOut("modprobe vfio-pci did not finish in 30 s")
        load(name)

    b.load_module = modprobe  # type: ignore[method-assign]
    daemon, _, notifier = make(kernel, ReadyConfig(), b=b)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=4 TPUs bound to vfio-pci"
        assert running.stop() == 0
    assert not slow  # the slow modprobe did happen


def test_vfio_node_event_reapplies_mode(kernel):
    daemon, monitor, _ = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        node = kernel.p("/dev/vfio/4")
        os.chmod(node, 0o600)  # as a udev rule running late would
        monitor.push("add", "vfio", "4")
        until(lambda: os.stat(node).st_mode & 0o777 == 0o666)
        running.stop()


def test_ready_waits_for_tpu_env_and_a_change_is_picked_up(kernel, emulator, root):
    env_file = root.path("/home/tpu-runtime/tpu-env")
    daemon, _, _ = make(
        kernel, config=with_env(emulator, watch=True), root=root, metadata=make_client(emulator)
    )
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert env_file.exists()  # READY came after tpu-env was written
        ready = daemon.notifier.sent[0]
        assert ready.startswith("READY=1\nSTATUS=4 TPUs bound to vfio-pci; tpu-env: ")
        assert "keys from metadata" in ready
        emulator.set_attribute("tpu-env", "WORKER_ID: '7'\n")
        until(lambda: daemon.notifier.last_status.endswith("tpu-env: 1 key from metadata"))
        assert env_file.read_text() == 'WORKER_ID="7"\n'
        running.stop()


def test_metadata_down_serves_tpu_env_from_cache_and_keeps_running(kernel, emulator, root):
    config = make_config(emulator)
    EnvSync(root, config, make_client(emulator)).sync_once(5.0)  # a good boot fills the cache
    root.path("/home/tpu-runtime/tpu-env").unlink()
    emulator.stop()
    client = make_client(emulator, timeout=0.2)
    daemon, _, _ = make(kernel, config=with_env(emulator, boot_deadline=0.5), root=root, metadata=client)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert "metadata server unreachable" in daemon.notifier.last_status
        assert "from cache of" in daemon.notifier.last_status
        assert root.path("/home/tpu-runtime/tpu-env").exists()
        running.stop()


def test_sigterm_during_a_long_metadata_wait_stops_at_once(kernel, emulator, root):
    emulator.set_faults(delay=3600.0)  # never answered while the test lasts
    client = make_client(emulator, timeout=3600.0)
    daemon, _, _ = make(kernel, config=with_env(emulator, boot_deadline=3600.0), root=root, metadata=client)

    def drive(daemon: Daemon) -> None:
        until(lambda: emulator.request_count >= 1)
        assert not daemon.ready
        os.kill(os.getpid(), signal.SIGTERM)

    assert serve_here(daemon, drive, within=60.0) == 0  # the stop, not the answer an hour away
    assert daemon.notifier.sent == ["STOPPING=1\nSTATUS=stopping"]


def test_binds_started_before_the_loop_are_adopted_not_redone(kernel, caplog):
    """`tpuboot run` submits the coldplug binds before importing the daemon: each runs once."""
    b = binder(kernel)
    calls: list[str] = []
    bind = b.bind

    def counted(address: str, **kwargs: object):
        calls.append(address)
        return bind(address, **kwargs)

    b.bind = counted  # type: ignore[method-assign]
    daemon, _, notifier = make(kernel, b=b)
    tpus = [f"0000:00:0{4 + i}.0" for i in range(4)]  # not the virtio disk
    assert sorted(daemon.devices.coldplug.binds) == tpus  # submitted by build, before any loop
    assert "0000:00:02.0" in daemon.devices.coldplug.addresses
    with caplog.at_level("INFO", logger="tpuboot"), serving(daemon) as running:
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=4 TPUs bound to vfio-pci"
        assert running.stop() == 0
    assert [daemon.devices.devices[a].attempts for a in tpus] == [1] * 4  # no second bind started
    daemon.executor.shutdown(wait=True)  # whatever the pool still had, it has run
    assert sorted(calls) == tpus  # each ran once: adopted, not submitted again
    logged = [
        r.getMessage().split()[0] for r in caplog.records if "bound to vfio-pci, /dev/vfio/" in r.getMessage()
    ]
    assert sorted(logged) == tpus  # and each result was handled as usual


def test_an_unexpected_exception_in_the_boot_sync_still_reaches_ready_on_the_cache(
    kernel, emulator, root, monkeypatch
):
    """Before: the exception ended `tpuboot run` before READY, without the last good copy."""
    config = make_config(emulator)
    EnvSync(root, config, make_client(emulator)).sync_once(5.0)  # a good boot fills the cache
    root.path("/home/tpu-runtime/tpu-env").unlink()
    parse = envsync.parse_tpu_env

    def buggy(text, **kwargs):
        if isinstance(text, bytes):  # the metadata value; the cached copy still parses
            raise ValueError("day is out of range for month")
        return parse(text, **kwargs)

    monkeypatch.setattr(envsync, "parse_tpu_env", buggy)
    client = make_client(emulator)
    daemon, _, _ = make(kernel, config=with_env(emulator), root=root, metadata=client)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert "unexpected ValueError (see the log), 14 keys from cache of" in daemon.notifier.last_status
        assert root.path("/home/tpu-runtime/tpu-env").exists()
        assert running.stop() == 0


def test_even_a_sync_that_raises_reaches_ready_and_starts_the_watch(kernel, emulator, root, monkeypatch):
    daemon, _, _ = make(
        kernel, config=with_env(emulator, watch=True), root=root, metadata=make_client(emulator)
    )
    env = daemon.part(EnvService)
    assert env is not None
    watched = threading.Event()
    monkeypatch.setattr(env.sync, "sync_once", lambda deadline: 1 / 0)
    monkeypatch.setattr(envservice, "watch_tpu_env", lambda sync, stop, report: watched.set())
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        assert daemon.notifier.sent[0].endswith("; tpu-env: failed (ZeroDivisionError); see the log")
        until(watched.is_set)
        assert running.stop() == 0


def test_a_bug_in_the_environment_writer_leaves_tpu_env_standing_and_is_logged_once(
    kernel, emulator, root, monkeypatch, caplog
):
    """/etc/environment is another file: a bug in its writer is logged with its traceback and said
    in STATUS, and tpu-env, written, still counts."""
    monkeypatch.setattr(envsync, "ensure_environment", lambda *args: 1 / 0)
    daemon, _, _ = make(kernel, config=with_env(emulator), root=root, metadata=make_client(emulator))
    with caplog.at_level("ERROR", logger="tpuboot"), serving(daemon) as running:
        until(lambda: daemon.ready)
        assert daemon.notifier.sent[0].endswith(
            "; tpu-env: 14 keys from metadata; /etc/environment not written (ZeroDivisionError)"
        )
        assert running.stop() == 0
    assert (root.path("/home/tpu-runtime/tpu-env")).is_file()
    bugs = [r for r in caplog.records if r.exc_info]
    assert len(bugs) == 1 and "/etc/environment" in bugs[0].getMessage()


def test_a_bug_in_a_retry_is_logged_by_the_loop_and_the_daemon_goes_on(kernel, monkeypatch, caplog):
    """A retry's timer (``_reconsider``) has no guard of its own: the loop's logs the bug with its
    traceback, and the next event for the device is handled as usual."""
    daemon, _, _ = make(kernel)
    address = "0000:00:05.0"

    def buggy(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the retry")

    with caplog.at_level("ERROR", logger="tpuboot"), serving(daemon) as running:
        until(lambda: daemon.ready)
        state = daemon.devices.devices[address]
        with monkeypatch.context() as patch:
            patch.setattr(daemon.devices, "_consider", buggy)
            daemon.loop.call_soon_threadsafe(daemon.devices._reconsider, address, state)
            until(lambda: any(r.exc_info and "_reconsider" in r.getMessage() for r in caplog.records))
        done = threading.Event()
        daemon.loop.call_soon_threadsafe(lambda: (daemon.devices.consider(address), done.set()))
        until(done.is_set)
        assert kernel.driver(address) == "vfio-pci"
        assert running.stop() == 0


def test_the_watch_thread_starts_a_watch_again_that_raised(monkeypatch, caplog):
    """The env service's watch (tpuboot/env/watch.py, its one restart): a watch that raised is
    started again after 1 s, then 2 s, each new bug logged with its traceback."""
    calls: list[float] = []
    stop = threading.Event()

    class Sync:
        bugs = Bugs("/tpu-env")
        etag = None
        tpu_env_path = "/tpu-env"

        def changes(self, stop_: threading.Event) -> Iterator[Change]:
            calls.append(time.monotonic())
            if len(calls) < 3:
                raise RuntimeError(f"bug {len(calls)}")
            stop.set()
            return iter(())

        def apply(self, change: Change) -> SyncResult:
            raise AssertionError("no change comes")

        def report(self, result: SyncResult) -> None:
            pass

    waits: list[float] = []
    monkeypatch.setattr(stop, "wait", lambda delay: waits.append(delay) or stop.is_set())
    assert envservice.watch_tpu_env is watch_tpu_env  # the one the service runs
    with caplog.at_level("ERROR", logger="tpuboot"):
        watch_tpu_env(Sync(), stop, lambda result: None)
    assert len(calls) == 3 and waits == [1.0, 2.0]
    assert len([r for r in caplog.records if r.exc_info]) == 2


# --- READY with ready.wait_for_devices (the default): every coldplugged TPU bound or failed for good


def test_ready_waits_until_a_transient_failure_is_retried_into_a_bind(kernel, monkeypatch):
    monkeypatch.setattr(
        manager, "BACKOFF_FIRST", 0.2
    )  # five retries over 6 s: the test clears the cause well within
    kernel.refuse_probe.add("0000:00:05.0")
    daemon, _, notifier = make(kernel, ReadyConfig())
    with serving(daemon) as running:
        until(lambda: getattr(daemon.devices.devices.get("0000:00:05.0"), "attempts", 0) >= 2)
        assert not daemon.ready and notifier.sent == []  # the first attempt failed: no READY yet
        kernel.refuse_probe.clear()  # the transient cause goes away; the next retry binds it
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=4 TPUs bound to vfio-pci"
        running.stop()


def test_ready_comes_once_the_retries_are_spent(kernel, monkeypatch):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(manager, "BACKOFF_CAP", 0.01)
    kernel.refuse_probe.add("0000:00:05.0")
    daemon, _, notifier = make(kernel, ReadyConfig())
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        state = daemon.devices.devices["0000:00:05.0"]
        assert (state.state, state.attempts, state.retry) == ("failed", 6, None)  # 1 + vfio.retries
        assert notifier.sent[0].startswith("READY=1\nSTATUS=3 of 4 TPUs bound to vfio-pci; 0000:00:05.0: ")
        running.stop()


def test_a_permanent_failure_does_not_hold_ready(tmp_path):
    noiommu = FakeKernel(tmp_path / "noiommu")
    add_tpu(noiommu, "0000:00:04.0", V5P, driver=None, group=None)
    daemon, _, notifier = make(noiommu, ReadyConfig())
    with serving(daemon) as running:
        until(lambda: daemon.ready)  # long before the deadline
        assert "0 of 1 TPU bound to vfio-pci; 0000:00:04.0: no IOMMU group" in notifier.sent[0]
        running.stop()


def test_the_device_deadline_bounds_the_wait_and_retries_go_on(kernel, monkeypatch, caplog):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 3600.0)  # the first retry would come long after
    kernel.refuse_probe.add("0000:00:05.0")
    caplog.set_level("WARNING", logger="tpuboot.devices.manager")
    daemon, _, notifier = make(kernel, ReadyConfig(device_deadline=0.3))
    started = time.monotonic()
    with serving(daemon) as running:
        until(lambda: daemon.ready, timeout=60)
        # The deadline, not the retry an hour away (the bound only catches a hang; the text below
        # says which ended the wait).
        assert 0.3 <= time.monotonic() - started < 600.0
        assert notifier.sent[0].startswith("READY=1\nSTATUS=3 of 4 TPUs bound to vfio-pci")
        assert daemon.devices.devices["0000:00:05.0"].retry is not None  # still to be retried
        running.stop()
    assert "ready: 3 of 4 TPUs bound after 0.3 s (ready.device_deadline); READY now" in caplog.text


def test_a_device_removed_while_ready_waits_for_it_releases_ready(kernel, monkeypatch):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 30.0)
    kernel.refuse_probe.add("0000:00:05.0")
    daemon, monitor, notifier = make(kernel, ReadyConfig())
    with serving(daemon) as running:
        until(lambda: getattr(daemon.devices.devices.get("0000:00:05.0"), "retry", None) is not None)
        assert not daemon.ready
        kernel.remove_device("0000:00:05.0")
        monitor.push("remove", "pci", "0000:00:05.0")
        until(lambda: daemon.ready)
        assert notifier.sent[0] == "READY=1\nSTATUS=3 TPUs bound to vfio-pci"
        running.stop()


# --- guest attributes: the daemon's state, fed to the publisher -----------------------------------


def test_the_state_reaches_the_guest_attributes_from_ready_and_ready_never_waits_for_them(
    kernel, emulator, root, monkeypatch
):
    """The guest attributes are an after-boot part: made once READY=1 went out, so READY never
    waits for them, and the first state they are handed is READY's. Before, they started with the
    boot and wrote state=starting first; the boot path (issue 32) no longer starts them before READY."""
    from tpuboot import __version__
    from tpuboot.config import GuestAttributesConfig
    from tpuboot.gce.guestattrs import Publisher

    handed: list[str] = []
    update = Publisher.update

    def recorded(self: Publisher, values: dict[str, str]) -> None:
        handed.append(values["state"])
        update(self, values)

    monkeypatch.setattr(Publisher, "update", recorded)
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    config = with_env(emulator).replace(guest_attributes=GuestAttributesConfig(min_interval=0.3))
    emulator.hold_writes()  # no write answered: READY must not wait for them
    daemon, _, notifier = make(kernel, ReadyConfig(), config, root=root, metadata=make_client(emulator))
    assert daemon.part(GuestAttributes) is None  # not made before READY

    def written() -> dict[str, str]:
        return emulator.guest_attributes("tpuboot")

    with serving(daemon) as running:
        guest_attrs = after_boot_part(daemon, GuestAttributes)
        assert guest_attrs.publisher.client is daemon.metadata  # one client
        assert any(m.startswith("READY=1") for m in notifier.sent) and written() == {}
        emulator.release_writes()
        until(lambda: len(written()) == 5 and written()["tpuboot/state"] == "ready", timeout=30)
        # The TPUs' PCIe state comes from the daemon's first tick: the fake kernel's are well.
        until(lambda: written()["tpuboot/tpus"] == "bound=4 expected=4 failed=0 pcie=ok", timeout=30)
        values = written()
        assert values["tpuboot/tpu-env"].startswith("source=metadata keys=14 updated=20")
        assert values["tpuboot/vbar"] == "disabled"
        assert values["tpuboot/version"] == __version__
        running.stop()
    assert emulator.guest_attributes("tpuboot")["tpuboot/state"] == "stopped"
    assert handed and set(handed) == {"ready"}  # never state=starting


def test_the_tpu_env_attribute_keeps_what_the_file_holds_through_a_failure(emulator, root):
    service = EnvService(EnvSync(root, make_config(emulator), make_client(emulator)), 1.0, False)
    assert service.attribute() == "source=pending" and service.status().state == "pending"
    service.result(SyncResult("failed", 0, None, "tpu-env: failed"))
    assert service.attribute() == "source=failed" and not service.held
    service.result(SyncResult("metadata", 14, "e1", "tpu-env: 14 keys from metadata"))
    written = service.attribute()
    assert written.startswith("source=metadata keys=14 updated=20") and written.endswith("Z")
    service.result(SyncResult("failed", 0, None, "tpu-env: metadata server unreachable"))
    assert service.attribute() == written and service.held  # the file still holds it
    assert service.status() == Status("failed", "tpu-env: metadata server unreachable")
    service.result(SyncResult("absent", 0, None, "tpu-env: not set"))
    assert service.attribute() == "source=absent" and not service.held


def test_one_metadata_client_is_shared_and_closed_at_stop(kernel, emulator, root):
    """tpu-env, the GKE check and the guest attributes ask through one client; stopping closes it
    after the last write, and the metrics endpoint build started is shut down."""
    config = with_env(emulator).replace(
        vbar=VbarConfig(), gke="auto", guest_attributes=GuestAttributesConfig(enabled="true"),
        metrics=MetricsConfig(port=free_port()))  # fmt: skip
    client = make_client(emulator)
    daemon, _, _ = make(kernel, config=config, root=root, metadata=client)
    env = daemon.part(EnvService)
    assert daemon.metadata is client and env is not None
    with serving(daemon) as running:
        containers, endpoint = after_boot_part(daemon, Containers), after_boot_part(daemon, MetricsEndpoint)
        assert containers.metadata is client and daemon.part(GuestAttributes) is not None
        assert env.sync.parsed_values == containers.tpu_env
        until(lambda: endpoint.server is not None)  # opened in its own thread
        server = endpoint.server
        assert server is not None
        assert running.stop() == 0
    with pytest.raises(MetadataError):
        client.get("instance/attributes/tpu-env", deadline_s=1.0)  # closed
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.server_port), timeout=1).close()


class OverflowingMonitor(QueueMonitor):
    """A monitor whose socket overflowed once: the next read fails with ENOBUFS, as the kernel's does."""

    def __init__(self) -> None:
        super().__init__()
        self.overflowed = False

    def overflow(self) -> None:
        self.overflowed = True
        self.tx.send(b"x")

    def poll(self, timeout: float | None = None) -> Event | None:
        if self.overflowed:
            self.overflowed = False
            self.rx.recv(1)
            raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))
        return super().poll(timeout)


def test_lost_udev_events_are_recovered_from_sysfs(kernel, caplog):
    """An add and a remove the kernel dropped (ENOBUFS) are found by reading sysfs again."""
    caplog.set_level("INFO", logger="tpuboot")
    monitor, notifier = OverflowingMonitor(), RecordingNotifier()
    config = DEVICES_ONLY.replace(ready=FIRST_ATTEMPT)
    daemon = build(kernel.root, config, binder=binder(kernel), monitor=monitor, notifier=notifier)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        add_tpu(kernel, "0000:00:0a.0", V5P, driver=None, group="10")
        kernel.remove_device("0000:00:07.0")
        monitor.overflow()  # neither event arrives
        until(lambda: kernel.driver("0000:00:0a.0") == "vfio-pci")
        until(lambda: notifier.last_status == "4 TPUs bound to vfio-pci")
        monitor.push("add", "pci", "0000:00:02.0")  # the monitor is read on as before
        until(lambda: not monitor.events)  # and its event read (a PCI function not a TPU: left)
        assert running.stop() == 0
    assert "udev: events were lost (receive buffer full)" in caplog.text
    assert "0000:00:07.0 (TPU v5p) removed" in caplog.text
    assert kernel.driver("0000:00:02.0") == "virtio-pci"


def test_ready_logs_the_boot_budget_and_keeps_it_for_status_boot(kernel, emulator, root, caplog, capsys):
    caplog.set_level("INFO", logger="tpuboot")
    daemon, _, _ = make(kernel, config=with_env(emulator), root=root, metadata=make_client(emulator))
    with serving(daemon) as running:
        until(lambda: daemon.ready and root.path(bootbudget.BUDGET_PATH).exists())
        assert running.stop() == 0
    (line,) = [r for r in caplog.records if r.getMessage().startswith("boot budget: ")]
    text = line.getMessage()
    for phase in ("monitor-open", "coldplug-enumerated", "4 binds", "metadata-answered", "tpu-env-written",
                  "etc-environment", "ready"):  # fmt: skip
        assert phase in text, text
    fields = vars(line)
    assert float(fields["TPUBOOT_BOOT_READY"]) >= float(fields["TPUBOOT_BOOT_TPU_ENV_WRITTEN"])
    assert fields["TPUBOOT_BOOT_BINDS"].count("=") == 4
    recorded = json.loads(root.path(bootbudget.BUDGET_PATH).read_text())
    names = [p["phase"] for p in recorded["phases"]]
    assert names.count("bind") == 4 and names[-1] == "ready"
    assert [p["seconds"] for p in recorded["phases"]] == sorted(p["seconds"] for p in recorded["phases"])
    assert cli.main(["--root", str(root.prefix), "status", "--boot"]) == cli.EXIT_OK
    shown = capsys.readouterr().out
    assert " s  bind 0000:00:04.0" in shown and shown.rstrip().endswith(" s  ready")
    assert "started" not in shown  # the test tree has no /proc/self/stat: no kernel-relative start


def test_a_tpu_hot_added_after_ready_is_not_part_of_the_boot(kernel):
    daemon, monitor, _ = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        add_tpu(kernel, "0000:00:0a.0", V5P, group="10")
        monitor.push("add", "pci", "0000:00:0a.0")
        until(lambda: kernel.driver("0000:00:0a.0") == "vfio-pci")
        running.stop()
    budget = daemon.part(BootBudget)
    assert budget is not None
    assert sorted(p.detail for p in budget.budget.phases() if p.name == bootbudget.BIND) == [
        f"0000:00:0{4 + i}.0" for i in range(4)
    ]


def test_status_boot_without_a_record_says_why(tmp_path, capsys):
    assert cli.main(["--root", str(tmp_path), "status", "--boot"]) == cli.EXIT_FAILED
    assert "tpuboot run has not said READY since this boot" in capsys.readouterr().err
