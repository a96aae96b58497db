"""recovery.automatic on a fake kernel: a wedged chip (fell off the bus, a fatal error since its
last good reset) is reset up the ladder, a held one never, each reason to leave one be said once,
a healthy one untouched; and the daemon runs it at its tick."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import unwedge, wedge
from tpuboot import metrics
from tpuboot.config import VfioConfig
from tpuboot.devices import health as health_module
from tpuboot.devices.chips import Chip
from tpuboot.devices.health import read_health, read_healths, save_baseline
from tpuboot.devices.recovery import WEDGED, AutoRecovery, wedged
from tpuboot.devices.snapshot import DeviceSnapshot
from tpuboot.devices.table import GOOGLE, DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.metrics_catalog import AUTOMATIC_RESETS

A = "0000:05:00.0"
V5P = (GOOGLE, 0x0062, (GOOGLE, 0x00AD))


class Holders:
    """Who holds each chip, as the /proc scan would say."""

    def __init__(self) -> None:
        self.by_chip: dict[str, list[str]] = {}

    def __call__(self, chip: Chip) -> list[str]:
        return self.by_chip.get(chip.address, [])


def setup(tmp_path: Path, limit: int = 3) -> tuple[FakeKernel, AutoRecovery, Holders]:
    kernel = FakeKernel(tmp_path)
    kernel.load_module("vfio-pci")
    kernel.add_device(A, V5P[0], V5P[1], V5P[2], driver="vfio-pci", group="30")
    kernel.p("/dev/vfio/30").chmod(0o666)
    kernel.p(f"/sys/bus/pci/devices/{A}/reset").touch()
    kernel.p(f"/sys/bus/pci/devices/{A}/reset_method").write_text("flr\n")
    kernel.p(f"/sys/bus/pci/devices/{A}/aer_dev_fatal").write_text("TOTAL_ERR_FATAL 0\n")
    binder = Binder(
        kernel.root,
        DeviceTable(),
        VfioConfig(node_timeout=0.05),
        write=kernel.write,
        load_module=kernel.load_module,
    )
    holders = Holders()
    recovery = AutoRecovery(binder, limit, holders)
    recovery.ladder.sleep = lambda s: None
    recovery.ladder.rescan_timeout = 0.5
    return kernel, recovery, holders


def fatal(kernel: FakeKernel, count: int) -> None:
    kernel.p(f"/sys/bus/pci/devices/{A}/aer_dev_fatal").write_text(f"DLP {count}\nTOTAL_ERR_FATAL {count}\n")


def resets(kernel: FakeKernel) -> int:
    return sum(1 for path, value in kernel.writes if path.endswith(f"{A}/reset") and value == "1")


def test_a_reset_is_for_two_of_doctors_kinds_of_finding() -> None:
    from tpuboot.devices.health import KINDS

    assert set(WEDGED) <= set(KINDS) and "degraded" not in WEDGED  # a reset cannot retrain a link


def test_a_healthy_chip_is_left_alone(tmp_path: Path, recorded: metrics.Metrics) -> None:
    kernel, recovery, _ = setup(tmp_path)
    recovery.check()
    assert resets(kernel) == 0 and recorded.series(AUTOMATIC_RESETS) == {}


def test_a_chip_that_fell_off_the_bus_is_reset_and_comes_back(
    tmp_path: Path, recorded: metrics.Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    kernel, recovery, _ = setup(tmp_path)
    wedge(kernel, A)
    kernel.on_reset = lambda address: unwedge(kernel, address)
    with caplog.at_level(logging.INFO, logger="tpuboot"):
        recovery.check()
    assert resets(kernel) == 1 and kernel.driver(A) == "vfio-pci"
    assert recorded.counters[AUTOMATIC_RESETS][("0000:05:00", "recovered")].value == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "tpuboot.recovery"]
    assert messages == [
        f"chip 0000:05:00: {A} does not answer config reads (vendor id 0xffff): it fell off the bus; "
        "resetting it (recovery.automatic)",
        "chip 0000:05:00: function-reset brought it back",
    ]
    recovery.check()  # back: nothing more to do
    assert resets(kernel) == 1


def test_a_fatal_error_since_the_last_good_reset_is_reset_once(
    tmp_path: Path, recorded: metrics.Metrics
) -> None:
    kernel, recovery, _ = setup(tmp_path)
    fatal(kernel, 1)
    (chip,) = recovery.chips(DeviceSnapshot(recovery.binder))
    assert wedged(chip, read_healths(kernel.root, [A])) == f"{A} logged 1 fatal PCIe error(s) since boot"
    recovery.check()
    assert resets(kernel) == 1  # the reset's baseline makes that error history
    recovery.check()
    assert resets(kernel) == 1
    fatal(kernel, 2)  # a new one
    recovery.check()
    assert resets(kernel) == 2
    assert recorded.counters[AUTOMATIC_RESETS][("0000:05:00", "recovered")].value == 2


def test_a_held_chip_is_never_reset_and_that_is_said_once(
    tmp_path: Path, recorded: metrics.Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    kernel, recovery, holders = setup(tmp_path)
    holders.by_chip["0000:05:00"] = ["PID 42 (tester, sleeping, train.service): python3 train.py"]
    fatal(kernel, 1)
    with caplog.at_level(logging.WARNING, logger="tpuboot.recovery"):
        recovery.check()
        recovery.check()
    assert resets(kernel) == 0 and recorded.series(AUTOMATIC_RESETS) == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        f"chip 0000:05:00: {A} logged 1 fatal PCIe error(s) since boot; not reset while it may be held: "
        "PID 42 (tester, sleeping, train.service): python3 train.py"
    )
    holders.by_chip.clear()  # the job ended
    recovery.check()
    assert resets(kernel) == 1


def test_the_breaker_bounds_automatic_resets_and_a_chip_that_never_comes_back_is_said(
    tmp_path: Path, recorded: metrics.Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    kernel, recovery, _ = setup(tmp_path, limit=2)
    wedge(kernel, A)
    kernel.on_reset = lambda address: None  # nothing brings it back: every rung fails
    add_device = kernel.add_device

    def add_wedged(address: str, *args: object, **kwargs: object) -> None:
        add_device(address, *args, **kwargs)  # type: ignore[arg-type]
        wedge(kernel, address)  # a rescan finds it as wedged as before

    kernel.add_device = add_wedged  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="tpuboot.recovery"):
        for _ in range(4):
            recovery.check()
    assert recorded.counters[AUTOMATIC_RESETS][("0000:05:00", "failed")].value == 2  # the breaker's limit
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("did not come back from any reset" in e for e in errors)
    refused = [
        r.getMessage() for r in caplog.records if "recovery.max_resets_per_hour is 2" in r.getMessage()
    ]
    assert len(refused) == 1  # said once, not at every tick


def test_a_reset_baseline_from_the_command_counts_for_the_daemon_too(tmp_path: Path) -> None:
    """`tpuboot reset` and the daemon share the baseline: an error the command cleared is history."""
    kernel, recovery, _ = setup(tmp_path)
    fatal(kernel, 3)
    save_baseline(kernel.root, [read_health(kernel.root, A)])
    recovery.check()
    assert resets(kernel) == 0


def test_the_daemon_resets_a_wedged_chip_at_its_tick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recovery.automatic on: the daemon's tick (TICK_INTERVAL without a watchdog) finds the chip
    that fell off the bus and brings it back; off (the default), the daemon has no recovery."""
    from tests.unit.helpers.daemon import DEVICES_ONLY, after_boot_part, make, serving, until, with_after_boot
    from tpuboot import daemon as daemon_module
    from tpuboot.config import RecoveryConfig

    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(daemon_module, "TICK_INTERVAL", 0.05)
    kernel, _, _ = setup(tmp_path)
    assert with_after_boot(make(kernel)[0]).part(AutoRecovery) is None  # off by default
    daemon, _, _ = make(kernel, config=DEVICES_ONLY.replace(recovery=RecoveryConfig(automatic=True)))
    with serving(daemon) as running:
        after_boot_part(daemon, AutoRecovery)  # after READY: the tick is armed for it
        wedge(kernel, A)
        kernel.on_reset = lambda address: unwedge(kernel, address)
        until(lambda: resets(kernel) == 1, timeout=20)
        until(lambda: kernel.driver(A) == "vfio-pci")
        running.stop()
    daemon.executor.shutdown(wait=True)  # the tick's climb ends here, its metric not in the next test's


def test_one_tick_reads_the_devices_once_for_every_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, emulator
) -> None:
    """Recovery, the guest attribute's PCIe summary and the runtime metrics' holder scan all on:
    one listing of the PCI functions and one health reading per function a tick (the tick's device
    snapshot), and each reader gets it (the wedged chip reset, its state summarised, its holders
    looked for)."""
    from tests.unit.helpers.daemon import DEVICES_ONLY, make, with_after_boot
    from tests.unit.helpers.metadata import make_client
    from tpuboot.config import GuestAttributesConfig, RecoveryConfig
    from tpuboot.derived import GuestAttributes
    from tpuboot.devices import survey as survey_module
    from tpuboot.runtime import collector as runtime_collector
    from tpuboot.runtime.collector import RuntimeCollector

    kernel, _, _ = setup(tmp_path)
    config = DEVICES_ONLY.replace(
        recovery=RecoveryConfig(automatic=True), guest_attributes=GuestAttributesConfig(enabled="true")
    )
    daemon = with_after_boot(make(kernel, config=config, metadata=make_client(emulator))[0])
    recovery, attributes = daemon.part(AutoRecovery), daemon.part(GuestAttributes)
    runtime = daemon.part(RuntimeCollector)
    assert recovery is not None and attributes is not None and runtime is not None
    recovery.ladder.sleep = lambda s: None
    read: list[str] = []
    listed: list[object] = []
    real_health, real_list = health_module.read_health, survey_module.list_addresses
    scanned: list[object] = []
    real_scan = runtime_collector.scan_holders

    def counted(root, address, baselines=None):  # type: ignore[no-untyped-def]
        read.append(address)
        return real_health(root, address, baselines)

    def listing(root):  # type: ignore[no-untyped-def]
        listed.append(root)
        return real_list(root)

    def scan(root, config, chips=None):  # type: ignore[no-untyped-def]
        scanned.append(chips)
        return real_scan(root, config, chips)

    monkeypatch.setattr(health_module, "read_health", counted)
    monkeypatch.setattr(survey_module, "list_addresses", listing)
    monkeypatch.setattr(runtime_collector, "scan_holders", scan)
    fatal(kernel, 1)
    daemon._periodic_work()
    assert read == [A]  # once, for both (the ladder's own check after its reset is its own)
    assert len(listed) == 1  # one survey for the three of them
    assert resets(kernel) == 1
    assert attributes.pcie == "fatal:1"  # the summary is of the tick's reading, before the reset
    if runtime.periodic:  # grpcio here: the collector looks for holders of the snapshot's chips
        assert [[chip.address for chip in chips] for chips in scanned] == [["0000:05:00"]]


@pytest.mark.parametrize("unseen", ["unreadable", "device fd of no named chip"])
def test_a_partial_scan_or_a_holder_of_a_chip_unknown_is_never_reset_under(
    tmp_path: Path,
    recorded: metrics.Metrics,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    unseen: str,
) -> None:
    """The real /proc scan (on a fake /proc): what it could not see, or tie to a chip, may hold
    this chip, so recovery waits; once it is gone, the chip is reset."""
    from tests.unit.fakes.proc import FakeProc
    from tests.unit.helpers.holders import refuse_fds
    from tpuboot.holders.report import blockers_of

    kernel, recovery, _ = setup(tmp_path)
    recovery.holders = blockers_of(recovery.binder.root)
    proc = FakeProc(tmp_path)
    if unseen == "unreadable":
        proc.add(200, {4: "/dev/vfio/30"})
        refuse_fds(monkeypatch, 200)
    else:
        proc.add(200, {5: "anon_inode:[vfio-device]"})  # no fdinfo naming its device: Linux before 6.18
    fatal(kernel, 1)
    with caplog.at_level(logging.WARNING, logger="tpuboot.recovery"):
        recovery.check()
    assert resets(kernel) == 0 and recorded.series(AUTOMATIC_RESETS) == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "not reset while it may be held: " in said
    assert ("could not be read" if unseen == "unreadable" else "chip unknown") in said
    proc.remove(200)
    recovery.check()
    assert resets(kernel) == 1
