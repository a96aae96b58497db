"""An idle daemon wakes for the watchdog, the long-polls and one round of tick work, nothing else.

The daemon as `tpuboot run` builds it (tpuboot.wiring.build) over the fake kernel, serving in a
thread, with a loop whose selector counts its wake-ups (tests/unit/helpers/eventloop.py). Once the
boot's and READY's work is behind, a window of ten WATCHDOG=1 beats is measured: the loop's
wake-ups, the rounds of the parts' tick work in the pool, the metadata server's requests and the
voluntary context switches of the parts' own threads (/proc/self/task/TID/status: each one a
wake-up from a sleep).
"""

from __future__ import annotations

import threading
import time

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import (
    DEVICES_ONLY,
    after_boot_part,
    guest_attribute_values,
    make,
    serving,
    until,
)
from tests.unit.helpers.devices import four_tpus_and_a_disk
from tests.unit.helpers.eventloop import CountingSelector
from tests.unit.helpers.metadata import make_client
from tests.unit.helpers.runproc import free_port
from tpuboot.config import (
    EnvConfig,
    GuestAttributesConfig,
    MetadataConfig,
    MetricsConfig,
    NoticesConfig,
    RecoveryConfig,
)
from tpuboot.containers.cdi_file import SpecWriter
from tpuboot.daemon import Daemon
from tpuboot.eventloop import EventLoop
from tpuboot.metrics_endpoint import MetricsEndpoint
from tpuboot.paths import Root

#: A maintenance window the server announces: each notice key then has a value to long-poll (an
#: absent upcoming-maintenance is read every 30 s instead, tpuboot/notices/watch.py).
SCHEDULED = {
    "maintenanceType": "SCHEDULED",
    "windowStartTime": "2099-12-05T14:05:00Z",
    "maintenanceStatus": "PENDING",
}
#: The long-polls of the window: tpu-env's watch and one per notice key.
LONG_POLLS = 4


@pytest.fixture
def kernel(tmp_path):
    return four_tpus_and_a_disk(FakeKernel(tmp_path))


@pytest.fixture
def watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # WATCHDOG=1 every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)


def beats(daemon: Daemon) -> int:
    return daemon.notifier.sent.count("WATCHDOG=1")  # type: ignore[attr-defined]


def test_idle_the_daemon_wakes_only_for_the_watchdog(kernel, watchdog):
    """WATCHDOG=1 every half of WATCHDOG_USEC, and nothing else wakes an idle daemon: no polling."""
    selector = CountingSelector()
    daemon, _, _ = make(kernel, loop=EventLoop(selector))
    with serving(daemon) as running:
        # the boot's wake-ups are behind (the CDI spec's last write among them)
        cdi = daemon.part(SpecWriter)
        until(lambda: daemon.ready and beats(daemon) >= 2 and not (cdi and cdi.writing))
        started = time.monotonic()  # before the count: a pause between the two only lengthens elapsed
        wakeups, sent = selector.wakeups, beats(daemon)
        until(lambda: beats(daemon) >= sent + 10)
        elapsed, woken, ticks = time.monotonic() - started, selector.wakeups - wakeups, beats(daemon) - sent
        running.stop()
    assert ticks >= 10 and woken <= ticks + 1  # one wake-up per WATCHDOG=1 (and the one in progress)
    assert elapsed >= 0.099 * (ticks - 1)  # never more often than asked


def switches(names: tuple[str, ...]) -> dict[str, int]:
    """The voluntary context switches of this process's threads whose name starts with one of
    ``names``, by name and id (a thread that sleeps and is woken counts one)."""
    counts = {}
    for thread in threading.enumerate():
        if thread.name.startswith(names) and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
            except FileNotFoundError:  # ended meanwhile
                continue
            counts[f"{thread.name} {thread.native_id}"] = int(fields["voluntary_ctxt_switches"])
    return counts


#: The after-boot parts' own threads (the pool's, tpuboot_N, and the tick's readers of /proc do the
#: tick's work; the loop is counted by its selector).
PART_THREADS = ("tpuboot-env", "tpuboot-guest-attributes", "tpuboot-metrics", "tpuboot-notice")


def test_idle_with_the_after_boot_parts_one_tick_round_per_beat_and_the_long_polls_only(
    kernel, watchdog, emulator: MetadataEmulator, root: Root
):
    """Every after-boot part that ticks or sleeps running (tpu-env's watch and the notices' long-
    polls, the guest attributes, the runtime collector, recovery, the metrics endpoint), idle: per
    WATCHDOG=1 one wake-up of the loop and one round of tick work in the pool; the parts' threads
    sleep until a long-poll's answer, which the server holds for its timeout (60 s), so the window
    has no request and no wake-up of theirs."""
    emulator.set_attribute("enable-guest-attributes", "TRUE")
    emulator.announce(upcoming=SCHEDULED)
    config = DEVICES_ONLY.replace(
        env=EnvConfig(),
        metadata=MetadataConfig(host=emulator.host, timeout=2.0, boot_deadline=5.0, watch=True),
        notices=NoticesConfig(hooks_dir="/etc/tpuboot/maintenance.d"),
        guest_attributes=GuestAttributesConfig(enabled="true", min_interval=0.3),
        recovery=RecoveryConfig(automatic=True),
        metrics=MetricsConfig(port=free_port()),
    )
    selector = CountingSelector()
    daemon, _, _ = make(
        kernel, config=config, root=root, metadata=make_client(emulator), loop=EventLoop(selector)
    )
    rounds: list[float] = []
    tick_work = daemon._periodic_work

    def counted() -> None:
        rounds.append(time.monotonic())
        tick_work()

    daemon._periodic_work = counted  # type: ignore[method-assign]
    with serving(daemon) as running:
        endpoint = after_boot_part(daemon, MetricsEndpoint)
        until(lambda: endpoint.server is not None)
        assert emulator.wait_for_pollers(LONG_POLLS, timeout=20)

        def settled() -> bool:  # the guest attributes hold what the daemon shows, the PCIe state too
            shown = {f"tpuboot/{key}": value for key, value in guest_attribute_values(daemon).items()}
            return "pcie=ok" in shown["tpuboot/tpus"] and emulator.guest_attributes("tpuboot") == shown

        until(settled, timeout=30)
        sent = beats(daemon)
        until(lambda: beats(daemon) >= sent + 2)  # a beat or two with nothing to write
        wakeups, sent, requests, before = (
            selector.wakeups,
            beats(daemon),
            emulator.request_count,
            switches(PART_THREADS),
        )
        done = len(rounds)
        until(lambda: beats(daemon) >= sent + 10)
        woken, ticks, asked = (
            selector.wakeups - wakeups,
            beats(daemon) - sent,
            emulator.request_count - requests,
        )
        after, worked = switches(PART_THREADS), len(rounds) - done
        running.stop()
    assert ticks >= 10 and woken <= ticks + 1  # one wake-up per WATCHDOG=1 (and the one in progress)
    assert worked <= ticks + 1  # one round of tick work per beat
    assert asked == 0  # the long-polls hang: nothing asked anew
    assert len(before) >= 1 + LONG_POLLS  # the threads counted: tpu-env's watch, the notices', ...
    woke = {name: after[name] - count for name, count in before.items() if name in after}
    assert {name: n for name, n in woke.items() if n} == {}
