"""`tpuboot run` as systemd starts it, end to end in a subprocess with the libraries of the run (the
library matrix runs it with each row's): config read with PyYAML, the udev monitor opened with
pyudev, tpu-env fetched with requests/urllib3, metrics served with prometheus_client, READY and
STOPPING sent with python-systemd. Every boot takes this path; with Ubuntu 22.04's
prometheus_client it once ended at the metrics import, before READY.
"""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.runproc import free_port, port_open, tpuboot_run
from tpuboot.env.tpuenv import render_env_file


def test_run_starts_reports_ready_serves_metrics_and_stops_on_sigterm(
    tmp_path: Path, emulator: MetadataEmulator
) -> None:
    kernel = FakeKernel(tmp_path / "root")
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    port = free_port()
    config = (
        f"vbar: {{enabled: false}}\nmetrics: {{address: 127.0.0.1, port: {port}}}\n"
        "metadata: {boot_deadline: 20, watch: false}\n"
    )
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path) as daemon:
        seen = daemon.receive("READY=1")
        wait_until(lambda: port_open(port))  # the endpoint opens in its own thread: READY never waits
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        daemon.process.send_signal(signal.SIGTERM)
        seen += daemon.receive("STOPPING=1", 20)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0
    ready = next(message for message in seen if "READY=1" in message)
    assert "tpu-env: 14 keys from metadata" in ready, ready
    assert 'tpuboot_metadata_requests_total{outcome="ok"}' in scraped
    assert (kernel.top / "home/tpu-runtime/tpu-env").read_text() == render_env_file(SAMPLE_TPU_ENV)
    assert "Traceback" not in daemon.stderr, daemon.stderr
