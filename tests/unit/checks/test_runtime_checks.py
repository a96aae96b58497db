"""Doctor's runtime checks and NPD's ``libtpu`` condition, over the file the daemon writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tpuboot.checks import runtime as module
from tpuboot.checks.runtime import RuntimeChecks
from tpuboot.config import Config, RuntimeMetricsConfig
from tpuboot.paths import Root
from tpuboot.runtime import statefile


def port(**fields: object) -> dict[str, object]:
    return {"port": 8431, "pid": 42, "holder": "unit train.service", "hang": False, "slice_error": None,
            "error": None, **fields}  # fmt: skip


def verdicts(root: Root, config: Config | None = None) -> dict[str, tuple[str, str]]:
    checks = RuntimeChecks(root, config or Config())
    return {c.name: (r.status, r.detail) for c, check in checks.named() for r in [check(root)]}


@pytest.fixture
def root(tmp_path: Path) -> Root:
    return Root(tmp_path)


def test_nothing_polled_is_skip(root: Root) -> None:
    assert {s for s, _ in verdicts(root).values()} == {"SKIP"}


def test_a_healthy_job_passes(root: Root) -> None:
    statefile.save(root, [port()])
    found = verdicts(root)
    assert found["runtime-metrics"] == ("PASS", "libtpu answers on port 8431 (PID 42, unit train.service)")
    assert found["libtpu-hang"][0] == found["libtpu-slice-error"][0] == "PASS"


def test_a_hang_and_a_slice_error_fail(root: Root) -> None:
    statefile.save(root, [port(hang=True), port(port=8432, slice_error="ICI link 3\x1b[2J down")])
    found = verdicts(root)
    assert found["libtpu-hang"] == (
        "FAIL",
        "libtpu reports a hang (HANG_DETECTED) on port 8431 (PID 42, unit train.service)",
    )
    status, detail = found["libtpu-slice-error"]
    assert status == "FAIL" and detail.endswith("ICI link 3\\x1b[2J down")


def test_a_port_not_answering_is_a_warning(root: Root) -> None:
    statefile.save(
        root, [port(error="port 8431: ListSupportedMetrics: DEADLINE_EXCEEDED: Deadline Exceeded")]
    )
    assert verdicts(root)["runtime-metrics"][0] == "WARN"


def test_without_grpc_doctor_says_why_in_one_line(root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        module, "grpc_missing", lambda: "python3-grpcio is not installed: off (apt install python3-grpcio)"
    )
    status, detail = verdicts(root)["runtime-metrics"]
    assert status == "SKIP" and "apt install python3-grpcio" in detail and "\n" not in detail


def test_turned_off_is_skip(root: Root) -> None:
    config = dataclasses.replace(Config(), runtime_metrics=RuntimeMetricsConfig(enabled=False))
    statefile.save(root, [port(hang=True)])
    assert verdicts(root, config)["libtpu-hang"][0] == "SKIP"


def test_a_file_not_tpuboots_is_a_warning(root: Root) -> None:
    root.path(statefile.RUNTIME_PATH).parent.mkdir(parents=True)
    root.path(statefile.RUNTIME_PATH).write_text("{}")
    assert verdicts(root)["libtpu-hang"][0] == "WARN"
