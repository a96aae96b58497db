"""The daemon's collector against stand-in metric services on 127.0.0.1 (real gRPC, real
/proc/net/tcp): what it exports, that it polls only while a chip is held, and that each bad
service is one journal line while the other ports' readings stand."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from harness.listeners import Resetting, Silent
from harness.runtime_server import RuntimeServer, tpu7x, v5e
from tests.unit.helpers.runtime import JOB, ME, write_ports
from tpuboot.config import Config, RuntimeMetricsConfig
from tpuboot.holders.procfs import Process
from tpuboot.metrics_export import RuntimeExport
from tpuboot.paths import Root
from tpuboot.runtime import statefile
from tpuboot.runtime.collector import Holders, RuntimeCollector


@pytest.fixture
def tree(tmp_path: Path) -> Root:
    """The files' root (tpu-env, the state file); the listeners are found in this host's /proc."""
    return Root(tmp_path)


class Part:
    """A collector over ``tree`` whose holder scan answers what the test says."""

    def __init__(self, root: Root, timeout: float = 5.0) -> None:
        self.config = dataclasses.replace(
            Config(), runtime_metrics=RuntimeMetricsConfig(interval=300.0, timeout=timeout)
        )
        self.root = root
        self.held: dict[int, Process] = {}
        self.changed = threading.Event()
        self.collector = RuntimeCollector(
            root, self.config, holders=lambda: Holders(1, dict(self.held)), host="tpu-vm", proc=Root("/")
        )
        self.collector.start(self.changed.set)

    def ports(self, *ports: int) -> None:
        write_ports(self.root, self.config, ",".join(map(str, ports)))

    def poll(self, *ports: int):  # type: ignore[no-untyped-def]
        return self.collector.poll_once({ME: JOB}, ports, "v5litepod-4", "2x2")

    def exposition(self) -> str:
        registry = CollectorRegistry()
        registry.register(RuntimeExport(self.collector.snapshot))  # type: ignore[arg-type]
        return generate_latest(registry).decode()


@pytest.fixture
def part(tree: Root) -> Iterator[Part]:
    p = Part(tree)
    yield p
    p.collector.stop()


def test_gke_names_and_labels_with_the_holder(part: Part) -> None:
    with RuntimeServer(v5e(2)) as a, RuntimeServer(tpu7x(1)) as b:
        snapshot = part.poll(a.port, b.port)
        text = part.exposition()
    assert [len(p.reading.devices) for p in snapshot.ports if p.reading] == [2, 2]
    labels = f'make="cloud-tpu",model="v5litepod-4",pid="{ME}",tpu_topology="2x2"'
    assert f'duty_cycle{{accelerator_id="tpu-vm-0",holder="unit job.service",{labels}}} 37.5' in text
    assert (
        f'memory_used{{accelerator_id="tpu-vm-1",holder="unit job.service",{labels}}} 2.147483648e+09' in text
    )
    assert (
        f'memory_total{{accelerator_id="tpu-vm-1",holder="unit job.service",{labels}}} 1.7179869184e+010'
        in text
    )
    assert text.count("memory_total{") == 4  # the TPU7x chip's two devices each have their HBM
    assert f'tpuboot_runtime_metrics_up{{holder="unit job.service",pid="{ME}",port="{b.port}"}} 1.0' in text


def test_a_port_not_held_by_a_chip_holder_is_not_asked(part: Part) -> None:
    with RuntimeServer(v5e(1)) as server:
        snapshot = part.collector.poll_once({ME + 1_000_000: JOB}, (server.port,))
        assert server.calls == {}
    assert snapshot.ports == ()


def test_polls_only_while_a_chip_is_held(part: Part) -> None:
    with RuntimeServer(v5e(1)) as server:
        part.ports(server.port)
        part.collector.check()  # nothing held: no thread, no call
        assert not part.collector.polling and part.collector.polls == 0 and server.calls == {}
        part.held[ME] = JOB
        part.collector.check()
        assert part.changed.wait(30)  # STATUS changed: the first poll is in
        assert part.collector.status().state == "polling"
        assert statefile.load(part.root)["ports"][0]["pid"] == ME  # type: ignore[index]
        part.changed.clear()
        part.held.clear()
        part.collector.check()  # the holder went: the poller ends, the series go
        assert part.changed.wait(30)
        thread = part.collector._thread
        if thread is not None:
            thread.join(30)
    assert not part.collector.polling
    assert part.collector.snapshot().ports == ()
    assert "duty_cycle{" not in part.exposition()
    assert statefile.load(part.root) is None


def test_a_hang_is_a_metric_a_journal_line_the_state_file_and_status(part: Part, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "tpuboot.runtime")
    with RuntimeServer(v5e(1)) as server:
        part.poll(server.port)
        assert "tpuboot_runtime_hang_detected{" in part.exposition()
        server.set(hang=True, slice_error="ICI link 3 down")
        part.poll(server.port)
        part.poll(server.port)
        text = part.exposition()
    assert (
        f'tpuboot_runtime_hang_detected{{holder="unit job.service",pid="{ME}",port="{server.port}"}} 1.0'
        in text
    )
    who = f'holder="unit job.service",pid="{ME}",port="{server.port}"'
    assert f"tpuboot_runtime_slice_error_detected{{{who}}} 1.0" in text
    hangs = [r for r in caplog.records if getattr(r, "FAULT", None) == "hang"]
    assert len(hangs) == 1 and hangs[0].levelno == logging.ERROR  # once, not once per poll
    slices = [r for r in caplog.records if getattr(r, "FAULT", None) == "slice-error"]
    assert len(slices) == 1 and "ICI link 3 down" in slices[0].getMessage()
    data = statefile.load(part.root)
    assert data is not None and data["hang"] is True and data["slice_error"] == "ICI link 3 down"
    assert part.collector.status() == part.collector.status().__class__(
        "fault", f"libtpu: HANG detected (PID {ME})"
    )


@pytest.mark.parametrize("answer", ["garbage", "huge", "wrong-types", "unknown-names", "abort"])
def test_a_bad_answer_is_one_line_and_the_other_port_stands(part: Part, caplog, answer: str) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "tpuboot.runtime")
    with RuntimeServer(v5e(2)) as good, RuntimeServer(v5e(1)) as bad:
        bad.set(answer=answer)
        for _ in range(3):
            snapshot = part.poll(good.port, bad.port)
        text = part.exposition()
    said = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert getattr(said[0], "PORT", None) == str(bad.port)
    assert "\n" not in said[0].getMessage()
    good_reading = next(p.reading for p in snapshot.ports if p.port == good.port)
    assert good_reading is not None and len(good_reading.devices) == 2
    assert text.count("duty_cycle{") >= 2


@pytest.mark.parametrize("listener", [Silent, Resetting])
def test_a_service_that_hangs_or_resets_is_one_line(tree: Root, caplog, listener: type) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "tpuboot.runtime")
    part = Part(tree, timeout=1.0)  # what a silent service costs per poll
    with RuntimeServer(v5e(1)) as good, listener() as bad:
        for _ in range(2):
            snapshot = part.poll(good.port, bad.port)
        said = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1 and f"port {bad.port}" in said[0].getMessage()
        assert [p.port for p in snapshot.ports if p.reading is not None] == [good.port]
        assert (
            f'tpuboot_runtime_metrics_up{{holder="unit job.service",pid="{ME}",port="{bad.port}"}} 0.0'
            in part.exposition()
        )


def test_answering_again_is_said_once(part: Part, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "tpuboot.runtime")
    with RuntimeServer(v5e(1)) as server:
        server.set(answer="abort")
        part.poll(server.port)
        server.set(answer="normal")
        part.poll(server.port)
        part.poll(server.port)
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "UNAVAILABLE" in line]) == 1
    assert len([line for line in lines if "answers again" in line]) == 1


def test_a_garbage_port_list_is_one_line_and_the_default_is_polled(part: Part, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "tpuboot.runtime")
    write_ports(part.root, part.config, "84x1;;99999")
    part.held[ME] = JOB
    part.collector.check()
    part.collector.check()
    said = [r.getMessage() for r in caplog.records if "TPU_RUNTIME_METRICS_PORTS" in r.getMessage()]
    assert len(said) == 1 and "8431 and up" in said[0]
    assert part.collector._ports == (8431,)


def test_without_grpc_the_collector_is_off(tree: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    from tpuboot.runtime import collector as module

    monkeypatch.setattr(module, "grpc_missing", lambda: "python3-grpcio is not installed: off")
    p = Part(tree)
    p.held[ME] = JOB
    p.collector.check()
    assert p.collector.status().state == "off" and not p.collector.polling


def test_state_file_is_json_tpuboot_reads(tree: Root) -> None:
    statefile.save(
        tree, [{"port": 1, "pid": 2, "holder": "x", "hang": True, "slice_error": None, "error": None}]
    )
    assert json.loads(tree.path(statefile.RUNTIME_PATH).read_text())["hang"] is True
    tree.path(statefile.RUNTIME_PATH).write_text("[]")
    with pytest.raises(Exception, match="not tpuboot's runtime file"):
        statefile.load(tree)
