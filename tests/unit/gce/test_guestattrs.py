"""Guest attributes: published only when enabled, paced, coalesced, retried a bounded number of times."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from harness.listeners import Silent
from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.helpers.metadata import FAST_BACKOFF, make_client
from tpuboot.component import Status
from tpuboot.config import GuestAttributesConfig, parse_config
from tpuboot.errors import ConfigError
from tpuboot.gce.client import MetadataClient
from tpuboot.gce.guestattrs import RETRIES, SPACING, Publisher, PublisherSettings, parse_enabled
from tpuboot.wiring import publisher_settings

FAST = GuestAttributesConfig(min_interval=0.3)  # built directly: the file's floor is 30 s


@pytest.fixture
def publishers(emulator: MetadataEmulator) -> Iterator[Callable[..., Publisher]]:
    made: list[Publisher] = []

    def make(config: GuestAttributesConfig = FAST, clock: Callable[[], float] = time.monotonic) -> Publisher:
        settings = publisher_settings(config)
        publisher = Publisher(make_client(emulator), settings, check_deadline=5.0, clock=clock)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.stop()
        publisher.client.close()  # the owner's (the daemon closes its shared client after stop)


def test_the_config_section_becomes_the_publishers_plain_settings() -> None:
    """tpuboot/gce/ takes no config: the caller maps auto/true/false to None/True/False."""
    assert [
        publisher_settings(GuestAttributesConfig(enabled=e)).enabled for e in ("auto", "true", "false")
    ] == [
        None,
        True,
        False,
    ]
    assert publisher_settings(GuestAttributesConfig(min_interval=45.0)) == PublisherSettings(None, 45.0)


def test_the_publishers_status_follows_the_check(emulator, publishers) -> None:
    """Started with a report, it tells of each change of its state."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers()
    assert publisher.status().state == "checking"
    reported: list[Status] = []
    publisher.start(lambda: reported.append(publisher.status()))
    wait_until(lambda: bool(reported))
    assert [status.state for status in reported] == ["publishing"]
    assert publishers(GuestAttributesConfig(enabled="false")).status().state == "off"


@pytest.mark.parametrize(
    ("text", "enabled"),
    [("TRUE", True), ("true", True), ("True", True), ("1", True), ("t", True),
     ("FALSE", False), ("0", False), ("yes", False), ("on", False), ("", False), ("TRUE ", False)],
)  # fmt: skip
def test_enable_guest_attributes_is_read_as_gos_parsebool(text: str, enabled: bool) -> None:
    assert parse_enabled(text) is enabled


def test_enabled_instance_gets_every_key_read_back(emulator, publishers) -> None:
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers()
    publisher.update({"state": "ready", "tpus": "bound=4 expected=4 failed=0", "version": "0.1.0"})
    publisher.start()
    wait_until(lambda: len(emulator.guest_attributes("tpuboot")) == 3)
    assert emulator.guest_attributes("tpuboot") == {
        "tpuboot/state": "ready",
        "tpuboot/tpus": "bound=4 expected=4 failed=0",
        "tpuboot/version": "0.1.0",
    }


def test_the_project_value_counts_when_the_instance_has_none(emulator, publishers) -> None:
    emulator.set("project/attributes/enable-guest-attributes", "true")
    publisher = publishers()
    publisher.update({"state": "ready"})
    publisher.start()
    wait_until(lambda: emulator.guest_attributes() == {"tpuboot/state": "ready"})


@pytest.mark.parametrize("instance", [None, "FALSE"])
def test_nothing_is_written_when_disabled(emulator, publishers, caplog, instance) -> None:
    emulator.set_attribute("enable-guest-attributes", instance)
    emulator.set("project/attributes/enable-guest-attributes", "TRUE" if instance else None)
    publisher = publishers()
    publisher.update({"state": "ready"})
    with caplog.at_level(logging.INFO, logger="tpuboot.gce.guestattrs"):
        publisher.start()
        wait_until(lambda: publisher.enabled is False)
        publisher.update({"state": "stopping"})
        time.sleep(0.5)
    assert emulator.guest_attribute_writes == 0
    assert "guest attributes: not published (enable-guest-attributes" in caplog.text


def test_enabled_false_asks_the_server_nothing(emulator, publishers) -> None:
    publisher = publishers(GuestAttributesConfig(enabled="false"))
    publisher.update({"state": "ready"})
    publisher.start()
    time.sleep(0.3)
    assert emulator.request_count == 0


def test_changes_within_the_interval_are_coalesced_into_one_write_of_the_latest(emulator, publishers) -> None:
    """The interval runs on the publisher's clock, which only the test moves: 'not before it is
    over' cannot be overrun by a loaded machine, and the spacing (0.5 s) is told from it (1 s)."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    now = [1000.0]
    publisher = publishers(GuestAttributesConfig(min_interval=1.0), clock=lambda: now[0])
    publisher.update({"state": "starting"})
    publisher.start()
    wait_until(lambda: emulator.guest_attribute_writes == 1)
    for state in ("a", "b", "ready"):
        publisher.update({"state": state})
    now[0] += 0.6  # past the spacing between two writes, within the interval of this key
    publisher.update({"state": "ready"})  # the same value: it only wakes the publisher to look again
    time.sleep(0.5)  # a moment in which it may not write (no event can show it never does)
    assert emulator.guest_attribute_writes == 1  # not before the interval is over
    now[0] += 0.4
    publisher.update({"state": "ready"})
    wait_until(lambda: emulator.guest_attributes() == {"tpuboot/state": "ready"})
    now[0] += 2.0
    publisher.update({"state": "ready"})  # unchanged: not written again
    time.sleep(0.5)
    assert emulator.guest_attribute_writes == 2


def test_writes_are_spaced_under_the_servers_burst_limit(emulator, publishers) -> None:
    """SPACING between any two writes, on the publisher's clock, which only the test moves (the
    server's arrival times showed it only while load delayed no arrival)."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    now = [1000.0]
    publisher = publishers(clock=lambda: now[0])
    publisher.update({f"k{i}": "v" for i in range(5)})
    publisher.start()
    wait_until(lambda: emulator.guest_attribute_writes == 1)
    now[0] += SPACING - 0.1
    publisher.update({"k0": "v"})  # the same value: it only wakes the publisher to look again
    time.sleep(0.5)  # a moment in which it may not write (no event can show it never does)
    assert emulator.guest_attribute_writes == 1
    for written in range(2, 6):
        now[0] = 1000.0 + (written - 1) * SPACING  # the next write's time: one more, each time
        publisher.update({"k0": "v"})
        wait_until(lambda n=written: emulator.guest_attribute_writes == n)
    wait_until(lambda: len(emulator.guest_attributes()) == 5)


def test_update_returns_at_once_while_the_server_hangs(emulator, publishers) -> None:
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers()
    publisher.start()
    wait_until(lambda: publisher.enabled is True)
    emulator.hold_writes()
    publisher.update({"state": "starting"})
    wait_until(lambda: emulator.guest_attribute_writes == 1)  # in flight: the server holds it
    updated = threading.Event()

    def update() -> None:
        for i in range(100):
            publisher.update({"state": f"s{i}"})
        updated.set()

    threading.Thread(target=update, daemon=True).start()
    # Blocked behind the write, the updates would wait for as long as the server holds it: forever.
    assert updated.wait(30) and emulator.guest_attribute_writes == 1
    emulator.release_writes()
    wait_until(lambda: emulator.guest_attributes().get("tpuboot/state") == "s99")


def test_failed_writes_are_retried_a_bounded_number_of_times_and_logged_once(
    emulator, publishers, caplog
) -> None:
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers()
    with caplog.at_level(logging.WARNING, logger="tpuboot.gce.guestattrs"):
        publisher.start()
        wait_until(lambda: publisher.enabled is True)
        emulator.set_faults(status=503)
        publisher.update({"state": "ready"})
        wait_until(lambda: emulator.guest_attribute_writes == RETRIES)
        time.sleep(FAST.min_interval * 3)
        assert emulator.guest_attribute_writes == RETRIES
        messages = [r.getMessage() for r in caplog.records]
        assert sum("writing tpuboot/state failed" in m for m in messages) == 1, messages
        assert any(f"not written after {RETRIES} tries" in m for m in messages), messages
        emulator.set_faults()
        publisher.update({"state": "stopping"})  # a new value earns a new series
        wait_until(lambda: emulator.guest_attributes() == {"tpuboot/state": "stopping"})


def test_a_403_from_the_server_stops_publishing_with_one_warning(emulator, publishers, caplog) -> None:
    publisher = publishers(GuestAttributesConfig(enabled="true", min_interval=0.3))  # the server says no
    publisher.update({"state": "ready", "tpus": "bound=1 expected=1 failed=0"})
    with caplog.at_level(logging.WARNING, logger="tpuboot.gce.guestattrs"):
        reported: list[str] = []
        publisher.start(lambda: reported.append(publisher.status().state))
        wait_until(lambda: publisher.enabled is False)
        publisher.update({"state": "stopping"})
        time.sleep(0.8)
    assert emulator.guest_attribute_writes == 1
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "Guest attributes endpoint access is disabled." in warning
    assert "set enable-guest-attributes=TRUE" in warning
    assert reported == ["off"]  # the component said so


def test_stop_writes_the_final_state(emulator, publishers) -> None:
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers()
    publisher.update({"state": "ready"})
    publisher.start()
    wait_until(lambda: emulator.guest_attributes() == {"tpuboot/state": "ready"})
    publisher.stop(final={"state": "stopped"})
    assert emulator.guest_attributes() == {"tpuboot/state": "stopped"}


def test_the_last_word_carries_every_value_the_pacing_held_back(emulator, publishers) -> None:
    """A value updated just before stop (tpu-env written a moment after its first attribute) is
    still owed when the pacing's interval has not passed: stop writes it, after ``final``."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    publisher = publishers(GuestAttributesConfig(min_interval=3600))
    publisher.update({"state": "starting", "tpu-env": "source=pending"})
    publisher.start()
    wait_until(lambda: len(emulator.guest_attributes()) == 2)
    publisher.update({"tpu-env": "source=metadata keys=14"})  # due in an hour
    writes = emulator.guest_attribute_writes
    publisher.stop(final={"state": "stopped"})
    assert emulator.guest_attributes() == {
        "tpuboot/state": "stopped",
        "tpuboot/tpu-env": "source=metadata keys=14",
    }
    assert emulator.guest_attribute_writes == writes + 2  # nothing already written is written again


def test_stop_never_waits_for_an_unanswered_check_and_closing_the_client_ends_it() -> None:
    """The check of enable-guest-attributes held for good (a server that accepts and never says a
    word, no deadline in sight): stop returns while it is still in flight, and the client's close,
    which follows stop in the daemon, ends the thread."""
    with Silent() as server:
        url = f"http://127.0.0.1:{server.port}/computeMetadata/v1/"
        client = MetadataClient(url, timeout=3600, backoff=FAST_BACKOFF)
        publisher = Publisher(client, publisher_settings(FAST), check_deadline=3600)
        publisher.start()
        thread = publisher._thread
        wait_until(lambda: len(server.accepted) == 1)  # the check in flight, held
        stopped = threading.Event()
        threading.Thread(target=lambda: (publisher.stop(), stopped.set()), daemon=True).start()
        # Had stop waited for the check, it would wait as long as the server holds it: forever.
        assert stopped.wait(30) and thread is not None and thread.is_alive()
        assert publisher.enabled is None
        client.close()
        thread.join(30)
        assert not thread.is_alive()


def test_config_keys_and_the_floor_of_the_interval() -> None:
    config = parse_config("guest_attributes: {enabled: auto, min_interval: 45}\n", "f.yaml")
    assert (config.guest_attributes.enabled, config.guest_attributes.min_interval) == ("auto", 45.0)
    assert parse_config("guest_attributes: {enabled: no}\n", "f.yaml").guest_attributes.enabled == "false"
    with pytest.raises(ConfigError, match=r"f.yaml: guest_attributes.min_interval: 30 is below 36 s; the"):
        parse_config("guest_attributes: {min_interval: 30}\n", "f.yaml")


def test_the_floor_keeps_every_key_the_daemon_writes_within_the_servers_quota(tmp_path) -> None:
    """The quota is 10 guest-attribute queries a minute: every key at its fastest stays within it,
    and the floor counts every key the daemon writes (a new key must raise it)."""
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.daemon import guest_attribute_values, make
    from tpuboot.config import GUEST_ATTRIBUTE_KEYS, GUEST_ATTRIBUTES_MIN_INTERVAL

    daemon, _, _ = make(FakeKernel(tmp_path))
    try:
        assert len(guest_attribute_values(daemon)) == GUEST_ATTRIBUTE_KEYS
    finally:
        daemon.loop.close()
    assert GUEST_ATTRIBUTE_KEYS * 60.0 / GUEST_ATTRIBUTES_MIN_INTERVAL <= 10
    with pytest.raises(
        ConfigError, match=r"guest_attributes.enabled: 'maybe' is not one of auto, true, false"
    ):
        parse_config("guest_attributes: {enabled: maybe}\n", "f.yaml")


def test_tpuboot_run_publishes_its_state_and_the_last_word_at_stop(
    tmp_path, emulator: MetadataEmulator
) -> None:
    """The wiring in `tpuboot run` (tpuboot/commands/daemon.py), end to end in a subprocess as systemd
    starts it."""
    import signal

    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.runproc import free_port, tpuboot_run
    from tpuboot import __version__

    emulator.set_attribute("enable-guest-attributes", "TRUE")
    kernel = FakeKernel(tmp_path / "root")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    config = f"vbar: {{enabled: false}}\nmetrics: {{port: {free_port()}}}\nmetadata: {{watch: false}}\n"
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path) as daemon:
        daemon.receive("READY=1")
        wait_until(lambda: len(emulator.guest_attributes("tpuboot")) == 5, timeout=20)
        daemon.process.send_signal(signal.SIGTERM)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0, daemon.stderr
    written = emulator.guest_attributes("tpuboot")
    assert written["tpuboot/state"] == "stopped"
    # With or without the PCIe state, by whether the daemon's first tick read it before this write.
    assert written["tpuboot/tpus"] in ("bound=0 expected=0 failed=0", "bound=0 expected=0 failed=0 pcie=ok")
    assert written["tpuboot/tpu-env"].startswith("source=metadata keys=14 updated=")
    assert written["tpuboot/version"] == __version__
    assert "Traceback" not in daemon.stderr, daemon.stderr
