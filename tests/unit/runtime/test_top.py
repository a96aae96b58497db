"""`tpuboot top`: one poll with the collector's code, shown as tpu-info shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.listeners import Silent
from harness.runtime_server import RuntimeServer, tpu7x, v5e
from tests.unit.helpers.runtime import JOB, ME, write_ports
from tpuboot.config import Config
from tpuboot.paths import Root
from tpuboot.runtime import top
from tpuboot.runtime.collector import Holders


def look(root: Root, config: Config, held: bool = True):  # type: ignore[no-untyped-def]
    return top.look(root, config, holders=lambda: Holders(1, {ME: JOB} if held else {}), proc=Root("/"))


def test_each_device_with_its_holder(tmp_path: Path) -> None:
    root, config = Root(tmp_path), Config()
    with RuntimeServer(v5e(2)) as a, RuntimeServer(tpu7x(1)) as b:
        write_ports(root, config, f"{a.port},{b.port}")
        snapshot = look(root, config)
    lines = top.render(snapshot)
    assert lines[0] == "v5litepod-4 2x2"
    assert lines[1].startswith(f"port {min(a.port, b.port)}  PID {ME} (unit job.service)  python3 train.py")
    assert "  0              37.5%  1.00 GiB / 16.00 GiB (6%)" in lines
    assert lines.count("  no hang, no slice error") == 2
    assert top.healthy(snapshot)
    data = json.loads(json.dumps(top.as_dict(snapshot)))
    assert [len(p["devices"]) for p in data["ports"]] == [2, 2]


def test_a_fault_or_a_silent_port_is_unhealthy(tmp_path: Path) -> None:
    root, config = Root(tmp_path), Config()
    with RuntimeServer(v5e(1)) as server, Silent() as silent:
        write_ports(root, config, f"{server.port},{silent.port}")
        server.set(hang=True)
        snapshot = look(root, config)
    lines = top.render(snapshot)
    assert "  HANG DETECTED, no slice error" in lines
    assert any(line.startswith("  not answering: port") for line in lines)
    assert not top.healthy(snapshot)


def test_nothing_held_says_so(tmp_path: Path) -> None:
    snapshot = look(Root(tmp_path), Config(), held=False)
    assert top.render(snapshot)[0].startswith("no process holding a TPU chip") and top.healthy(snapshot)


def test_without_grpc_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tpuboot.runtime import collector

    monkeypatch.setattr(collector, "grpc_missing", lambda: "python3-grpcio is not installed")
    with pytest.raises(top.RuntimeOff, match="python3-grpcio"):
        look(Root(tmp_path), Config())
