"""`tpuboot slice` and `wait-slice` on a real network stack: three workers of a v4-24 slice, each in
its own network namespace with its own metadata emulator (tests/unit/slice/slicenet.py), firewalls
made with nftables inside a worker's namespace, peers that accept and never answer.

Connect timeouts are short (0.5 s) so a dropped port costs little; nothing asserts a duration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.slice.slicenet import AVAILABLE, WHY_NOT, SliceNet

pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)

WORKERS = 3
MACHINE = "projects/1/machineTypes/ct4p-hightpu-4t"  # 4 chips a host: v4-24 (12 chips) is 3 hosts
FAST = ("--connect-timeout", "0.5")


def tpu_env(worker: int) -> dict[str, str]:
    return {"ACCELERATOR_TYPE": "v4-24", "WORKER_ID": str(worker), "CHIPS_PER_HOST_BOUNDS": "2,2,1"}


@pytest.fixture
def net(tmp_path: Path) -> Iterator[SliceNet]:
    """Three workers, each told the truth about itself by its own emulator."""
    slicenet = SliceNet(tmp_path, WORKERS)
    try:
        for i in range(WORKERS):
            attributes = {"agent-worker-number": str(i), "worker-network-endpoints": slicenet.endpoints()}
            instance = {"network-interfaces/0/ip": slicenet.address(i), "machine-type": MACHINE}
            slicenet.metadata(i, attributes, instance)
            slicenet.config(i, tpu_env(i))
        yield slicenet
    finally:
        slicenet.close()


def verdict(net: SliceNet, worker: int) -> tuple[int, dict[str, object]]:
    done = net.tpuboot(worker, "slice", "--json", *FAST, "--timeout", "30")
    assert done.stderr == "", done.stderr
    report = json.loads(done.stdout)
    return done.returncode, report


def states(report: dict[str, object]) -> dict[tuple[int, int], str]:
    paths = report["paths"]
    assert isinstance(paths, list)
    return {(p["worker"], p["port"]): p["state"] for p in paths}


def statuses(report: dict[str, object]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    findings = report["findings"]
    assert isinstance(findings, list)
    for f in findings:
        found.setdefault(f["name"], []).append(f["status"])
    return found


def test_a_dropped_coordinator_port_fails_with_its_rule_and_the_rest_is_told_apart(net: SliceNet) -> None:
    net.listen(0, 8471, 8476)  # worker 0: SliceBuilder and the old coordinator port, never answering
    net.drop(0, 8482)  # jax 0.8.1's coordinator port: not in the firewall rule (jax #35905)
    code, report = verdict(net, 1)
    assert code == 1
    assert states(report) == {
        (0, 8471): "open",
        (0, 8476): "open",
        (0, 8482): "dropped",
        (2, 8471): "refused",
    }
    found = statuses(report)
    for name in ("worker-id", "worker-list", "own-address", "own-ports"):
        assert found[name] == ["PASS"], report
    (bad,) = [f for f in report["findings"] if f["name"] == "peer-path"]  # type: ignore[attr-defined]
    assert "worker 0 (127.10.0.1) port 8482" in bad["detail"] and "dropped" in bad["detail"]
    assert "tcp:8482" in bad["fix"]


def test_every_path_open_or_refused_passes(net: SliceNet) -> None:
    net.listen(2, 8471)
    code, report = verdict(net, 0)
    assert code == 0, report
    assert states(report) == {(1, 8471): "refused", (2, 8471): "open"}
    assert statuses(report)["peer-paths"] == ["PASS"]


def test_a_slice_port_held_on_this_host_is_named(net: SliceNet) -> None:
    holder = net.listen(1, 8471)  # a stale process of the last job, on worker 1 itself
    code, report = verdict(net, 1)
    assert code == 1
    (own,) = [f for f in report["findings"] if f["name"] == "own-ports"]  # type: ignore[attr-defined]
    assert own["status"] == "FAIL"
    assert f"tcp 8471 (SliceBuilder) is held by PID {holder.pid} " in own["detail"]
    assert "peer.py" in own["detail"]


def test_a_worker_with_no_route_is_unreachable(tmp_path: Path) -> None:
    net = SliceNet(tmp_path, 2)
    try:
        listed = [net.address(0), net.address(1), "127.20.0.3"]  # no route to 127.20.0.0/16 anywhere
        for i in range(2):
            net.metadata(
                i,
                {"agent-worker-number": str(i), "worker-network-endpoints": net.endpoints(listed)},
                {"network-interfaces/0/ip": net.address(i), "machine-type": MACHINE},
            )
            net.config(i, tpu_env(i))
        code, report = verdict(net, 0)
        assert code == 1
        assert states(report) == {(1, 8471): "refused", (2, 8471): "unreachable"}
    finally:
        net.close()


def test_two_workers_that_both_think_they_are_worker_0(tmp_path: Path) -> None:
    """Worker 1's metadata came up blank (marin #8743): its own check fails, naming the blank key."""
    net = SliceNet(tmp_path, 2)
    try:
        net.metadata(
            1,
            {
                "agent-worker-number": "",
                "worker-network-endpoints": net.endpoints([net.address(0), net.address(1), "127.10.0.3"]),
            },
            {"network-interfaces/0/ip": net.address(1), "machine-type": MACHINE},
        )
        net.config(1, {"ACCELERATOR_TYPE": "v4-24", "WORKER_ID": "0"})
        code, report = verdict(net, 1)
        assert code == 1
        failing = {f["name"]: f["detail"] for f in report["findings"] if f["status"] == "FAIL"}  # type: ignore[attr-defined]
        assert "agent-worker-number is blank" in failing["worker-id"]
        assert (
            "this host is 127.10.0.2, but worker 0's entry is 127.10.0.1; it stands at index 1"
            in failing["own-address"]
        )
    finally:
        net.close()


def test_wait_slice_sees_a_firewall_fixed(net: SliceNet) -> None:
    net.drop(2, 8471)
    waiting = net.tpuboot_started(1, "wait-slice", *FAST, "--interval", "0.2", "--timeout", "300")
    assert waiting.stderr is not None
    line = waiting.stderr.readline()  # the first look: what it waits for
    assert line.startswith("waiting for the slice: peer-path: worker 2 (127.10.0.3) port 8471"), line
    assert "dropped" in line
    net.undrop(2)
    out, err = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, err
    assert "the slice holds" in out


def test_wait_slice_gives_up_saying_what_is_wrong(net: SliceNet) -> None:
    net.drop(0, 8476)
    done = net.tpuboot(1, "wait-slice", *FAST, "--interval", "0.2", "--timeout", "1")
    assert done.returncode == 1
    assert "still does not hold after 1 s" in done.stderr
    assert "worker 0 (127.10.0.1) port 8476 (jax coordinator up to jax 0.8.0): dropped" in done.stderr
    assert "Traceback" not in done.stderr


def sweep_metrics(path: Path) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``tpuboot-slice.prom`` as node_exporter's parser reads it: family, labels, value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(path.read_text())
    }


def test_the_last_look_is_a_textfile_for_node_exporter(net: SliceNet, tmp_path: Path) -> None:
    """With metrics.textfile_dir set, `slice` and `wait-slice` leave their last look in
    tpuboot-slice.prom: every state counted (0 included), the FAILs, the time."""
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    config = tmp_path / "w1-tpuboot.yaml"
    config.write_text(config.read_text() + f"metrics: {{textfile_dir: '{textfiles}'}}\n")
    net.listen(0, 8471, 8476)
    net.drop(0, 8482)
    code, _ = verdict(net, 1)
    assert code == 1
    found = sweep_metrics(textfiles / "tpuboot-slice.prom")
    by_state = {dict(k)["state"]: v for k, v in found["tpuboot_slice_paths"].items()}
    assert by_state == {"open": 2.0, "refused": 1.0, "dropped": 1.0, "unreachable": 0.0, "error": 0.0}
    assert found["tpuboot_slice_failures"] == {(): 1.0}
    (when,) = found["tpuboot_slice_last_sweep_timestamp_seconds"].values()
    assert when > 1.7e9
    net.undrop(0)
    done = net.tpuboot(1, "wait-slice", *FAST, "--interval", "0.2", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    again = sweep_metrics(textfiles / "tpuboot-slice.prom")
    assert {dict(k)["state"]: v for k, v in again["tpuboot_slice_paths"].items()}["dropped"] == 0.0
    assert again["tpuboot_slice_failures"] == {(): 0.0}
    assert not (textfiles / "tpuboot.prom").exists()  # the slice's look has its own file
