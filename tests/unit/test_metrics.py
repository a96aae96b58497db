"""Metrics: names and values after real work (binds, metadata requests, tpu-env), the loopback
endpoint, the one-shot commands' textfile, promtool's verdict and a real Prometheus scraping the
daemon's endpoint."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.mds_emulator import MetadataEmulator
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import make, serving, until
from tests.unit.helpers.devices import V5P, add_tpu
from tests.unit.helpers.metadata import make_client, make_config
from tests.unit.helpers.runproc import free_port
from tpuboot import __version__, cli, metrics, metrics_export
from tpuboot.config import MetricsConfig
from tpuboot.devices import manager
from tpuboot.env.sync import EnvSync
from tpuboot.gce.replies import MetadataAbsent
from tpuboot.paths import Root

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


@pytest.fixture(autouse=True)
def fresh() -> Iterator[metrics.Metrics]:
    """Each test counts from zero in its own registry."""
    with metrics.use(metrics.Metrics()) as m:
        yield m


def samples(data: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    text = data.decode() if isinstance(data, bytes) else data
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(m: metrics.Metrics, name: str, **labels: str) -> float | None:
    return samples(metrics_export.exposition(m)).get((name, tuple(sorted(labels.items()))))


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read()


# --- names and values ------------------------------------------------------------------------


def test_recorded_values_are_shown_under_their_names(fresh):
    """Each recorded value under its metric's name and labels (which metrics there are, and their
    conventions: tests/unit/test_metrics_catalog.py)."""
    metrics.container_up("vbar", True)
    metrics.container_restarted("vbar")
    metrics.tpu_env_updated(from_cache=False, when=1_700_000_000.0)
    assert value(fresh, "tpuboot_build_info", version=__version__) == 1
    assert value(fresh, "tpuboot_container_restarts_total", container="vbar") == 1
    assert value(fresh, "tpuboot_container_up", container="vbar") == 1
    assert value(fresh, "tpuboot_tpu_env_last_update_timestamp_seconds") == 1_700_000_000
    metrics.notice("upcoming", True, 1_800_000_000.0)
    assert value(fresh, "tpuboot_notice", kind="upcoming") == 1
    assert value(fresh, "tpuboot_maintenance_window_start_timestamp_seconds") == 1_800_000_000
    # Counters exist at zero before the first event, so rate() sees the first one.
    for result in metrics.BIND_RESULTS:
        assert value(fresh, "tpuboot_bind_attempts_total", result=result) == 0


def test_a_dedicated_registry_not_the_global_one(fresh):
    from prometheus_client import REGISTRY

    assert metrics_export.registry_of(fresh) is not REGISTRY
    assert b"tpuboot_" not in __import__("prometheus_client").generate_latest(REGISTRY)


def test_metric_updates_never_raise(fresh, caplog):
    class Broken(dict):
        def __getitem__(self, key):
            raise RuntimeError("broken collector")

        def setdefault(self, key, default=None):
            raise RuntimeError("broken collector")

    fresh.counters = Broken()  # type: ignore[assignment]
    caplog.set_level(logging.DEBUG, logger="tpuboot.metrics")
    metrics.bind_attempt("bound", 0.1)
    metrics.metadata_request("ok")
    metrics.tpus([("TPU v5p", object())])  # type: ignore[list-item]
    assert "broken collector" in caplog.text


def test_tpu_states_drop_to_zero_when_no_longer_seen(fresh):
    metrics.tpus([("TPU v5p", "pending"), ("TPU v5p", "pending")])
    metrics.tpus([("TPU v5p", "bound"), ("TPU v5p", "failed")])
    assert value(fresh, "tpuboot_tpus", generation="TPU v5p", state="pending") == 0
    assert value(fresh, "tpuboot_tpus", generation="TPU v5p", state="bound") == 1
    assert value(fresh, "tpuboot_tpus", generation="TPU v5p", state="failed") == 1


# --- instrumentation ---------------------------------------------------------------------------


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    k = FakeKernel(tmp_path / "sys-root")
    for i in range(2):
        add_tpu(k, f"0000:00:0{4 + i}.0", V5P, driver=None, group=str(4 + i))
    k.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    return k


def run_daemon(kernel: FakeKernel, during=None) -> None:
    """Run the daemon until READY, then ``during()`` (off the loop), then SIGTERM-equivalent."""
    daemon, _, _ = make(kernel)
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        if during is not None:
            during()
        assert running.stop() == 0


def test_daemon_counts_binds_and_tpus_by_generation_and_state(fresh, kernel, monkeypatch):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 3600.0)  # its retry: long after the test
    kernel.refuse_probe.add("0000:00:05.0")  # vfio-pci does not take it: a transient failure
    run_daemon(kernel)
    assert value(fresh, "tpuboot_tpus", generation="TPU v5p", state="bound") == 1
    assert value(fresh, "tpuboot_tpus", generation="TPU v5p", state="failed") == 1
    assert value(fresh, "tpuboot_bind_attempts_total", result="bound") == 1
    assert value(fresh, "tpuboot_bind_attempts_total", result="failed_transient") == 1
    assert value(fresh, "tpuboot_bind_duration_seconds_count", result="bound") == 1


def test_metadata_requests_by_outcome(fresh, emulator: MetadataEmulator):
    client = make_client(emulator)
    client.on_request = metrics.metadata_request  # as tpuboot run and tpuboot env count
    try:
        client.get("instance/attributes/tpu-env", deadline_s=5)
        with pytest.raises(MetadataAbsent):
            client.get("instance/attributes/nope", deadline_s=5)
    finally:
        client.close()
    assert value(fresh, "tpuboot_metadata_requests_total", outcome="ok") == 1
    assert value(fresh, "tpuboot_metadata_requests_total", outcome="absent") == 1


def test_tpu_env_update_time_and_cache_flag(fresh, emulator: MetadataEmulator, root: Root):
    config = make_config(emulator)
    client = make_client(emulator)
    before = time.time()
    EnvSync(root, config, client).sync_once(5)
    assert value(fresh, "tpuboot_tpu_env_from_cache") == 0
    assert (value(fresh, "tpuboot_tpu_env_last_update_timestamp_seconds") or 0) >= before - 1
    client.close()
    emulator.stop()  # the server goes away: the next sync comes from the cache
    offline = make_client(emulator, timeout=0.2)
    offline.on_request = metrics.metadata_request
    try:
        result = EnvSync(root, config, offline).sync_once(0.5)
    finally:
        offline.close()
    assert result.source == "cache"
    assert value(fresh, "tpuboot_tpu_env_from_cache") == 1
    assert value(fresh, "tpuboot_metadata_requests_total", outcome="transient") >= 1


# --- serving -----------------------------------------------------------------------------------


def test_served_on_loopback_and_disabled_by_config(fresh):
    metrics.bind_attempt("bound", 0.2)
    assert metrics_export.serve(MetricsConfig(enabled=False)) is None
    server = metrics_export.serve(MetricsConfig(address="127.0.0.1", port=0))
    assert server is not None
    try:
        body = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert samples(body)[("tpuboot_bind_attempts_total", (("result", "bound"),))] == 1


def test_a_port_in_use_is_one_warning_line(fresh, caplog):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert metrics_export.serve(MetricsConfig(port=port)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


# --- the one-shot commands' textfile -------------------------------------------------------------


def test_one_shot_commands_write_a_textfile(fresh, emulator: MetadataEmulator, kernel, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    config = kernel.top / "tpuboot.yaml"
    config.write_text("metrics: {textfile_dir: /var/lib/node_exporter}\n")
    top = str(kernel.top)
    (kernel.top / "home/tpu-runtime").mkdir(parents=True)
    assert cli.main(["--root", top, "--config", "/tpuboot.yaml", "env"]) == cli.EXIT_OK
    prom = kernel.top / "var/lib/node_exporter/tpuboot.prom"
    found = samples(prom.read_text())
    assert found[("tpuboot_metadata_requests_total", (("outcome", "ok"),))] == 1
    assert found[("tpuboot_tpu_env_from_cache", ())] == 0
    assert found[("tpuboot_tpus", (("generation", "TPU v5p"), ("state", "unbound")))] == 2
    assert oct(prom.stat().st_mode & 0o777) == "0o644"
    # A refused bind (the boot disk, not a TPU) is counted as a failed attempt.
    assert cli.main(["--root", top, "--config", "/tpuboot.yaml", "bind", "00:02.0"]) == cli.EXIT_FAILED
    assert samples(prom.read_text())[("tpuboot_bind_attempts_total", (("result", "failed"),))] == 1
    assert not list(prom.parent.glob(".*")), "no temporary file left behind"


def test_the_slice_textfile_has_every_state_and_its_own_name(fresh, tmp_path):
    """`tpuboot slice`'s last look: a file beside tpuboot.prom, every state a series (0 included),
    Prometheus' conventions (a gauge per count, the time in unix seconds)."""
    root = Root(tmp_path)
    (tmp_path / "textfiles").mkdir()
    sweep = metrics_export.SliceSweep({"open": 2, "refused": 60, "dropped": 1}, 1, 1_700_000_000.0)
    config = MetricsConfig(textfile_dir="/textfiles")
    assert metrics_export.write_slice_textfile(root, config, sweep) == "/textfiles/tpuboot-slice.prom"
    text = (tmp_path / "textfiles/tpuboot-slice.prom").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: f.type for name, f in families.items()} == {
        "tpuboot_slice_paths": "gauge",
        "tpuboot_slice_failures": "gauge",
        "tpuboot_slice_last_sweep_timestamp_seconds": "gauge",
    }
    assert samples(text) == {
        ("tpuboot_slice_paths", (("state", "open"),)): 2,
        ("tpuboot_slice_paths", (("state", "refused"),)): 60,
        ("tpuboot_slice_paths", (("state", "dropped"),)): 1,
        ("tpuboot_slice_failures", ()): 1,
        ("tpuboot_slice_last_sweep_timestamp_seconds", ()): 1_700_000_000,
    }
    assert not (tmp_path / "textfiles/tpuboot.prom").exists()
    assert metrics_export.write_slice_textfile(root, MetricsConfig(), sweep) is None  # no directory


def test_no_textfile_without_a_directory(fresh, kernel, tmp_path):
    assert cli.main(["--root", str(kernel.top), "bind", "00:02.0"]) == cli.EXIT_FAILED
    assert not list(kernel.top.rglob("*.prom"))


# --- promtool and a real Prometheus ----------------------------------------------------------


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_finds_nothing_to_report_in_the_scraped_output(fresh, kernel):
    metrics.container_up("vbar", False)
    metrics.container_restarted("vbar")
    metrics.tpu_env_updated(from_cache=True)
    body: list[bytes] = []

    def scrape_once() -> None:
        server = metrics_export.serve(MetricsConfig(port=0))
        assert server is not None
        try:
            body.append(scrape(server.server_port))
        finally:
            server.shutdown()
            server.server_close()

    run_daemon(kernel, scrape_once)
    assert b"tpuboot_bind_attempts_total" in body[0]
    checked = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body[0], capture_output=True, timeout=60, check=False
    )
    assert checked.returncode == 0 and checked.stdout == b"" and checked.stderr == b"", checked


PROMETHEUS_CONFIG = """global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: tpuboot
    static_configs:
      - targets: ['127.0.0.1:{port}']
"""


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package prometheus)")
def test_a_real_prometheus_scrapes_the_daemons_endpoint(fresh, kernel, tmp_path):
    web = free_port()
    found: list[dict] = []

    def with_prometheus() -> None:
        server = metrics_export.serve(MetricsConfig(port=0))
        assert server is not None
        (tmp_path / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(port=server.server_port))
        argv = [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ]
        log = (tmp_path / "prometheus.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        query = f"http://127.0.0.1:{web}/api/v1/query?query=tpuboot_build_info"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(query, timeout=2) as response:
                        answer = json.load(response)
                except OSError:
                    answer = {}
                if answer.get("data", {}).get("result"):
                    found.extend(answer["data"]["result"])
                    return
                time.sleep(0.5)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            server.shutdown()
            server.server_close()

    run_daemon(kernel, with_prometheus)
    assert found, (tmp_path / "prometheus.log").read_text()[-3000:]
    series = found[0]["metric"]
    assert series["__name__"] == "tpuboot_build_info"
    assert series["version"] == __version__ and series["job"] == "tpuboot"


def test_a_textfile_that_cannot_be_written_changes_no_exit_status(fresh, kernel, capsys):
    (kernel.top / "blocked").write_text("a file where a directory should be\n")
    (kernel.top / "tpuboot.yaml").write_text("metrics: {textfile_dir: /blocked}\n")
    argv = ["--root", str(kernel.top), "--config", "/tpuboot.yaml", "bind", "00:02.0"]
    assert cli.main(argv) == cli.EXIT_FAILED  # the refused bind's status, not the file's
    assert "metrics: /blocked/tpuboot.prom: blocked is not a directory" in capsys.readouterr().err


def test_a_metric_update_keeps_its_signature_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """_safe wraps each update without erasing what it takes (the type checker sees it too)."""
    import inspect

    assert list(inspect.signature(metrics.bind_attempt).parameters) == ["result", "seconds"]
    assert list(inspect.signature(metrics.tpu_env_updated).parameters) == ["from_cache", "when"]
    assert metrics.bind_attempt.__name__ == "bind_attempt"
    assert "bind attempt" in (metrics.bind_attempt.__doc__ or "")
    said: list[object] = []
    monkeypatch.setattr(metrics.log, "debug", lambda *args: said.append(args))
    with metrics.use(metrics.Metrics()):
        metrics.bind_attempt("bound", "soon")  # type: ignore[arg-type]  # max(0.0, "soon") raises
    assert [args[:2] for args in said] == [("metric update %s failed: %s", "bind_attempt")]


def test_every_bind_result_label_is_a_bind_outcome() -> None:
    assert {metrics.bind_result(outcome) for outcome in (object(), TimeoutError(), metrics)} <= set(
        metrics.BIND_RESULTS
    )
