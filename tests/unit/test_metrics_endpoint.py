"""The daemon's metrics endpoint opens in its own thread: READY never waits for prometheus_client,
a failure to open leaves the daemon running, and a server that opens after the stop is shut."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.polling import wait_until
from tpuboot.metrics_endpoint import MetricsEndpoint

REPO = Path(__file__).resolve().parents[2]


class Server:
    """A stand-in for MetricsServer: records being shut down."""

    def __init__(self) -> None:
        self.shut = threading.Event()
        self.connections = 0

    def shutdown(self) -> None:
        self.shut.set()

    def server_close(self) -> None:
        pass


def test_the_daemons_boot_path_records_metrics_without_prometheus_client() -> None:
    """What `tpuboot run` imports up to READY (wiring's daemon, devices, tpu-env, containers)."""
    code = (
        "import sys\n"
        "import tpuboot.wiring, tpuboot.daemon, tpuboot.devices.manager, tpuboot.env.service\n"
        "import tpuboot.env.sync, tpuboot.containers.service, tpuboot.gce.client, tpuboot.metrics\n"
        "import tpuboot.metrics_endpoint\n"
        "tpuboot.metrics.bind_attempt('bound', 0.1); tpuboot.metrics.metadata_request('ok')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'wsgiref'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_server_is_there_once_open_has_returned() -> None:
    served = Server()
    opened = threading.Event()

    def open_it() -> Server:
        opened.wait(10)
        return served

    endpoint = MetricsEndpoint(open_it)  # type: ignore[arg-type]
    endpoint.start()
    assert endpoint.server is None  # not yet: the daemon runs on meanwhile
    opened.set()
    wait_until(lambda: endpoint.server is not None)
    assert endpoint.server is served
    endpoint.stop()
    assert served.shut.is_set() and endpoint.server is None


def test_a_server_that_opens_after_the_stop_is_shut_at_once() -> None:
    served = Server()
    release = threading.Event()
    endpoint = MetricsEndpoint(lambda: release.wait(10) and served)  # type: ignore[arg-type,return-value]
    endpoint.start()
    endpoint.stop()  # the daemon stops while the endpoint still opens
    release.set()
    assert served.shut.wait(10)
    assert endpoint.server is None


def test_a_failure_to_open_is_logged_and_leaves_no_server(caplog: pytest.LogCaptureFixture) -> None:
    done = threading.Event()

    def broken() -> None:
        try:
            raise ImportError("prometheus_client is broken")
        finally:
            done.set()

    caplog.set_level(logging.ERROR, logger="tpuboot.metrics")
    endpoint = MetricsEndpoint(broken)
    endpoint.start()
    assert done.wait(10)
    wait_until(lambda: "did not open" in caplog.text)  # logged after open() returned
    assert "metrics: the endpoint did not open; running without metrics" in caplog.text
    assert "prometheus_client is broken" in caplog.text
    assert endpoint.server is None
    endpoint.stop()  # nothing to shut: no error
