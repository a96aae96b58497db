"""The daemon with its runtime collector: nothing polled while no chip is held, duty cycle and HBM
on its /metrics once one is, a hang in STATUS, and the series gone with the holder."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from harness.listeners import Silent
from harness.runtime_server import RuntimeServer, v5e
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import (
    DEVICES_ONLY,
    FIRST_ATTEMPT,
    QueueMonitor,
    RecordingNotifier,
    after_boot_part,
    serving,
    until,
)
from tests.unit.helpers.devices import add_tpu, binder
from tests.unit.helpers.runtime import JOB, ME, write_ports
from tpuboot import metrics
from tpuboot.config import EnvConfig, MetricsConfig, RuntimeMetricsConfig
from tpuboot.metrics_endpoint import MetricsEndpoint
from tpuboot.paths import Root
from tpuboot.runtime.collector import Holders, RuntimeCollector
from tpuboot.wiring import build


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_the_daemon_exports_a_held_chips_metrics_and_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a tick every 0.1 s: the holders looked at each
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, driver="vfio-pci")
    config = DEVICES_ONLY.replace(
        ready=FIRST_ATTEMPT,
        env=EnvConfig(enabled=True),
        metrics=MetricsConfig(port=0),
        runtime_metrics=RuntimeMetricsConfig(interval=0.2),
    )
    held: dict[int, object] = {}
    collector = RuntimeCollector(
        kernel.root, config, holders=lambda: Holders(1, dict(held)), host="tpu-vm", proc=Root("/")
    )
    notifier = RecordingNotifier()
    with metrics.use(metrics.Metrics()), RuntimeServer(v5e(2)) as server:
        write_ports(kernel.root, config, str(server.port))
        daemon = build(kernel.root, config, binder=binder(kernel), monitor=QueueMonitor(),
                       notifier=notifier, runtime=collector)  # fmt: skip
        with serving(daemon) as running:
            endpoint = after_boot_part(daemon, MetricsEndpoint)
            until(lambda: endpoint.server is not None)
            port = endpoint.server.server_port  # type: ignore[union-attr]
            ticks = notifier.sent.count("WATCHDOG=1")
            until(lambda: notifier.sent.count("WATCHDOG=1") >= ticks + 3)
            assert server.calls == {} and not collector.polling  # nothing held: nothing asked
            held[ME] = JOB
            until(lambda: "duty_cycle{" in scrape(port))
            text = scrape(port)
            assert 'memory_total{accelerator_id="tpu-vm-1",holder="unit job.service"' in text
            until(lambda: any("libtpu: 2 devices read" in s for s in notifier.sent))
            server.set(hang=True)
            until(
                lambda: any(s.startswith("STATUS=") and "libtpu: HANG detected" in s for s in notifier.sent)
            )
            assert "tpuboot_runtime_hang_detected{" in scrape(port)
            held.clear()
            until(lambda: "duty_cycle{" not in scrape(port))
            until(lambda: not collector.polling)
            assert running.stop() == 0


def test_a_libtpu_that_never_answers_leaves_the_loop_and_watchdog_beating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, driver="vfio-pci")
    config = DEVICES_ONLY.replace(
        ready=FIRST_ATTEMPT, env=EnvConfig(enabled=True), runtime_metrics=RuntimeMetricsConfig(timeout=10.0)
    )
    collector = RuntimeCollector(
        kernel.root, config, holders=lambda: Holders(1, {ME: JOB}), host="tpu-vm", proc=Root("/")
    )
    notifier = RecordingNotifier()
    with Silent() as silent:
        write_ports(kernel.root, config, str(silent.port))
        daemon = build(kernel.root, config, binder=binder(kernel), monitor=QueueMonitor(),
                       notifier=notifier, runtime=collector)  # fmt: skip
        with serving(daemon) as running:
            until(lambda: daemon.ready and silent.accepted != [])  # a poll waits on its 10 s deadline
            beats = notifier.sent.count("WATCHDOG=1")
            until(lambda: notifier.sent.count("WATCHDOG=1") >= beats + 10)  # beating meanwhile
            assert running.stop() == 0
