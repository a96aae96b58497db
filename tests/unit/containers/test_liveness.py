"""vBar answers, or not: the endpoint grammar, the probe over real sockets, and the containers'
check against the fake dockerd (STATUS, the metric, the restart once unanswered long enough)."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.polling import wait_until
from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import Clock, engine_of
from tests.unit.helpers.runproc import free_port
from tpuboot import metrics
from tpuboot.config import Config, VbarConfig, parse_config
from tpuboot.containers.liveness import Liveness, probe
from tpuboot.containers.service import Containers
from tpuboot.endpoints import Endpoint, EndpointError, parse_endpoint
from tpuboot.errors import ConfigError
from tpuboot.metrics_catalog import CONTAINER_ENDPOINT_UP, CONTAINER_RESTARTS
from tpuboot.paths import Root


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("127.0.0.1:8353", Endpoint(host="127.0.0.1", port=8353)),
        ("[::1]:8353", Endpoint(host="::1", port=8353)),
        ("10.0.0.2:1", Endpoint(host="10.0.0.2", port=1)),
        ("unix:/var/run/tpu-plugin/vbar.sock", Endpoint(path="/var/run/tpu-plugin/vbar.sock")),
        ("/run/vbar.sock", Endpoint(path="/run/vbar.sock")),
        ("unix:/run//x/../vbar.sock", Endpoint(path="/run/vbar.sock")),
    ],
)
def test_endpoints_read_as_host_port_or_socket(text: str, endpoint: Endpoint) -> None:
    assert parse_endpoint(text) == endpoint
    assert parse_endpoint(str(endpoint)) == endpoint  # shown as it is read back


@pytest.mark.parametrize(
    "text",
    [
        "8353", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:+80",
        "127.0.0.1:\uff18\uff13", "localhost:8353", "node:8353", "::1:8353x", "unix:relative.sock", "unix:",
        "unix:/a\0b",
    ],
)  # fmt: skip
def test_endpoints_that_cannot_be_read_are_refused(text: str) -> None:
    with pytest.raises(EndpointError):
        parse_endpoint(text)


def test_the_configuration_reads_the_endpoint_and_the_restart_delay() -> None:
    assert Config().vbar.endpoint == Endpoint(host="127.0.0.1", port=8353)
    assert Config().vbar.restart_unanswered_after is None  # never restarted by default
    config = parse_config("vbar: {endpoint: 'unix:/run/v.sock', restart_unanswered_after: 90}\n", "f")
    assert config.vbar.endpoint == Endpoint(path="/run/v.sock")
    assert config.vbar.restart_unanswered_after == 90.0
    assert parse_config("vbar: {endpoint: ''}\n", "f").vbar.endpoint is None
    with pytest.raises(ConfigError, match=r"f: vbar\.endpoint: 'localhost:1': the host must be an IP"):
        parse_config("vbar: {endpoint: 'localhost:1'}\n", "f")
    with pytest.raises(ConfigError, match=r"restart_unanswered_after: 5 is below 10 s"):
        parse_config("vbar: {restart_unanswered_after: 5}\n", "f")
    with pytest.raises(ConfigError, match=r"needs vbar\.endpoint, which is empty"):
        parse_config("vbar: {endpoint: '', restart_unanswered_after: 60}\n", "f")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock


def test_the_probe_connects_over_tcp(listener: socket.socket, tmp_path: Path) -> None:
    root = Root(tmp_path)
    assert probe(Endpoint(host="127.0.0.1", port=listener.getsockname()[1]), root) is None
    assert probe(Endpoint(host="127.0.0.1", port=free_port()), root) == "connection refused"


def test_the_probe_connects_to_a_unix_socket_under_the_root() -> None:
    # A short root: a socket's path must fit sun_path (108 bytes), which pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        root = Root(Path(top))
        (Path(top) / "run").mkdir()
        endpoint = Endpoint(path="/run/vbar.sock")
        assert probe(endpoint, root) == "no such socket"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(Path(top) / "run/vbar.sock"))
            assert probe(endpoint, root) == "connection refused"  # a socket nobody listens on
            server.listen(1)
            assert probe(endpoint, root) is None
        (Path(top) / "run/plain").write_text("")
        assert probe(Endpoint(path="/run/plain"), root) == "connection refused"
    deep = Root(Path("/tmp") / ("d" * 120))
    assert probe(Endpoint(path="/run/vbar.sock"), deep).startswith("socket path too long")


def test_liveness_counts_from_the_first_unanswered_probe() -> None:
    liveness = Liveness(Endpoint(host="127.0.0.1", port=8353), restart_after=60.0)
    assert liveness.answering is None and liveness.detail() == ""
    assert liveness.observe(None, 0.0) is False and liveness.answering is True
    assert liveness.observe("connection refused", 10.0) is False
    assert liveness.detail() == ", not answering at 127.0.0.1:8353 (connection refused)"
    assert liveness.observe("connection refused", 69.0) is False
    assert liveness.observe("connection refused", 70.0) is True  # 60 s since the first refusal
    assert liveness.observe(None, 71.0) is False and liveness.failing_since is None
    assert liveness.observe("connection refused", 72.0) is False  # counted afresh
    liveness.forget()
    assert liveness.answering is None and liveness.detail() == ""
    never = Liveness(Endpoint(host="127.0.0.1", port=8353))
    assert not any(never.observe("connection refused", t) for t in (0.0, 1e6))


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


def vbar_containers(dockerd: FakeDockerd, port: int, restart_after: float | None, clock: Clock) -> Containers:
    vbar = VbarConfig(endpoint=Endpoint(host="127.0.0.1", port=port), restart_unanswered_after=restart_after)
    config = Config(gke="false", vbar=vbar)
    dockerd.images.add(config.vbar.image)
    containers = Containers(config, Root(dockerd.root), None, clock=clock)
    containers.tpu_vm_seen("a TPU is present")
    return containers


def test_a_running_vbar_that_stops_answering_shows_in_status_and_metrics(
    dockerd: FakeDockerd, recorded: metrics.Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    port, clock = free_port(), Clock()
    containers = vbar_containers(dockerd, port, None, clock)
    reports = threading.Semaphore(0)
    containers.start(reports.release)
    try:
        wait_until(lambda: containers.statuses()["vBar"].detail == "running")
        assert recorded.series(CONTAINER_ENDPOINT_UP) == {}  # not checked yet
        with caplog.at_level(logging.INFO, logger="tpuboot.containers.service"):
            containers.check_endpoints()
        detail = f"running, not answering at 127.0.0.1:{port} (connection refused)"
        assert containers.statuses()["vBar"].detail == detail
        assert containers.status().detail == f"vBar: {detail}" and containers.status().state == "running"
        assert recorded.series(CONTAINER_ENDPOINT_UP) == {("vBar",): 0.0}
        (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
        assert warning.getMessage() == f"vBar: not answering at 127.0.0.1:{port}: connection refused"
        assert warning.__dict__["ENDPOINT"] == f"127.0.0.1:{port}"
        caplog.clear()
        clock.now += 3600.0
        containers.check_endpoints()  # still refused: nothing new said, never restarted (off)
        assert not caplog.records and dockerd.calls("POST", "/containers/.*/kill") == []
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen(1)
            with caplog.at_level(logging.INFO, logger="tpuboot.containers.service"):
                containers.check_endpoints()
        assert containers.statuses()["vBar"].detail == "running"
        assert recorded.series(CONTAINER_ENDPOINT_UP) == {("vBar",): 1.0}
        assert [r.getMessage() for r in caplog.records] == [f"vBar: answering at 127.0.0.1:{port}"]
    finally:
        containers.stop()


def test_vbar_unanswered_past_its_delay_is_restarted_by_its_supervisor(
    dockerd: FakeDockerd, recorded: metrics.Metrics
) -> None:
    port, clock = free_port(), Clock()
    containers = vbar_containers(dockerd, port, 60.0, clock)
    containers.start(lambda: None)
    try:
        wait_until(lambda: containers.statuses()["vBar"].detail == "running")
        name = containers.config.vbar.container_name
        first = dockerd.containers[name]["Id"]
        containers.check_endpoints()
        clock.now += 59.0
        containers.check_endpoints()
        assert dockerd.calls("POST", "/containers/.*/kill") == []  # 59 s: not yet
        clock.now += 1.0
        containers.check_endpoints()
        (kill,) = dockerd.calls("POST", "/containers/.*/kill")
        assert first in kill.path
        wait_until(lambda: containers.supervisors["vBar"].starts == 2 and dockerd.running(name), timeout=15)
        wait_until(lambda: containers.statuses()["vBar"].detail == "running")
        assert recorded.counters[CONTAINER_RESTARTS][("vBar",)].value == 1
        assert recorded.series(CONTAINER_ENDPOINT_UP) == {}  # the new container: not judged yet
        containers.check_endpoints()  # the successor is judged afresh: 0 s unanswered
        assert len(dockerd.calls("POST", "/containers/.*/kill")) == 1
    finally:
        containers.stop()


def test_an_agent_not_running_is_not_probed(dockerd: FakeDockerd) -> None:
    clock = Clock()
    containers = vbar_containers(dockerd, free_port(), 10.0, clock)  # never started
    containers.check_endpoints()
    assert containers.statuses()["vBar"].detail == "starting"
    assert containers.checks_endpoints
    off = Containers(Config(gke="false", vbar=VbarConfig(endpoint=None)), Root(dockerd.root), None)
    assert not off.checks_endpoints


def test_the_daemon_ticks_for_the_check_without_a_watchdog(
    dockerd: FakeDockerd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run by hand (no WATCHDOG_USEC) the daemon still ticks, at TICK_INTERVAL, for the check; the
    answer shows in STATUS both ways."""
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.daemon import DEVICES_ONLY, make, serving, until
    from tests.unit.helpers.devices import V5P, add_tpu
    from tpuboot import daemon as daemon_module

    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(daemon_module, "TICK_INTERVAL", 0.05)
    kernel = FakeKernel(tmp_path / "kernel")
    add_tpu(kernel, "0000:00:04.0", V5P, driver=None, group="4")
    port = free_port()
    vbar = VbarConfig(endpoint=Endpoint(host="127.0.0.1", port=port))
    config = DEVICES_ONLY.replace(gke="false", vbar=vbar)
    dockerd.images.add(config.vbar.image)
    daemon, _, notifier = make(kernel, config=config, root=Root(dockerd.root), engine=engine_of(dockerd))
    with serving(daemon) as running:
        until(lambda: "not answering at" in notifier.last_status, timeout=20)
        refused = f"vBar: running, not answering at 127.0.0.1:{port} (connection refused)"
        assert notifier.last_status.endswith(refused)
        assert "WATCHDOG=1" not in notifier.sent
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen(4)
            until(lambda: notifier.last_status.endswith("vBar: running"), timeout=20)
        running.stop()
