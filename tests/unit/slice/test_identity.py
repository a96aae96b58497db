"""This worker's identity judged from its facts, and bad input at the command line: one line, exit 1,
no traceback, no unbounded wait. No namespace: the CLI cases run against the metadata emulator on
127.0.0.1 and a --root tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.helpers.runproc import free_port
from tpuboot import cli
from tpuboot.env.tpuenv import render_env_file
from tpuboot.paths import Root
from tpuboot.slice.facts import Facts
from tpuboot.slice.identity import judge
from tpuboot.slice.workers import MAX_WORKERS, WorkerListError, parse_endpoints, parse_hostnames

MACHINE = "projects/1/machineTypes/ct4p-hightpu-4t"
ENDPOINTS = "w0:0:10.0.0.1,w1:1:10.0.0.2,w2:2:10.0.0.3"
ENV = {"ACCELERATOR_TYPE": "v4-24", "WORKER_ID": "1"}


def facts(**changes: object) -> Facts:
    base: dict[str, object] = {
        "env": dict(ENV),
        "env_problem": None,
        "worker_number": "1",
        "endpoints": ENDPOINTS,
        "own_address": "10.0.0.2",
        "machine_type": MACHINE,
    }
    base.update(changes)
    return Facts(**base)  # type: ignore[arg-type]


def failing(f: Facts) -> dict[str, str]:
    return {r.name: r.detail for r in judge(f).findings if r.status == "FAIL"}


def test_a_consistent_worker_holds() -> None:
    identity = judge(facts())
    assert identity.holds and identity.worker == 1 and len(identity.workers) == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "entry 0"),
        ("w0:0:10.0.0.1,,w2:2:10.0.0.3", "entry 1"),
        ("w0:0:", "entry 0"),
        ("w0:0:10.0.0.1,w1:1:fe80::1", "entry 1"),
        ("garbage", "is not NAME:ID:IP"),
        ("a:b:not an address", "no usable address"),
        (",".join(f"w{i}:{i}:10.0.{i // 256}.{i % 256}" for i in range(10_000)), "10000 entries"),
    ],
)
def test_a_malformed_worker_list_is_refused_naming_the_entry(text: str, says: str) -> None:
    with pytest.raises(WorkerListError) as caught:
        parse_endpoints(text)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_largest_pod_fits() -> None:
    text = ",".join(f"w{i}:{i}:10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(MAX_WORKERS))
    assert len(parse_endpoints(text)) == MAX_WORKERS
    assert [w.address for w in parse_hostnames("a.example, b.example")] == ["a.example", "b.example"]


@pytest.mark.parametrize(
    ("changes", "name", "says"),
    [
        (
            {"worker_number": "", "env": {"ACCELERATOR_TYPE": "v4-24"}},
            "worker-id",
            "agent-worker-number is blank",
        ),
        ({"worker_number": None}, "worker-id", "agent-worker-number is blank (tpu-env says worker 1)"),
        ({"worker_number": "one"}, "worker-id", "agent-worker-number 'one' is not a worker number"),
        ({"worker_number": "3"}, "worker-id", "agent-worker-number 3 is outside the slice"),
        ({"worker_number": "2"}, "worker-id", "agent-worker-number 2 but tpu-env's WORKER_ID '1'"),
        ({"endpoints": "w0:0:10.0.0.1"}, "worker-list", "has 1 workers; the slice has 3 hosts"),
        (
            {"endpoints": "w0:0:10.0.0.1,w1:1:10.0.0.1,w2:2:10.0.0.3"},
            "worker-list",
            "gives 10.0.0.1 to workers 0, 1",
        ),
        ({"endpoints": None}, "worker-list", "no worker-network-endpoints and no TPU_WORKER_HOSTNAMES"),
        ({"own_address": "10.0.0.1"}, "own-address", "worker 1's entry is 10.0.0.2; it stands at index 0"),
        ({"env": {**ENV, "MEGASCALE_NUM_SLICES": "2"}}, "multislice", "not MEGASCALE_COORDINATOR_ADDRESS"),
        (
            {
                "env": {
                    **ENV,
                    "MEGASCALE_NUM_SLICES": "2",
                    "MEGASCALE_SLICE_ID": "2",
                    "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1",
                }
            },
            "multislice",
            "MEGASCALE_SLICE_ID '2' is not a slice of 0 to 1",
        ),
        ({"env": None, "env_problem": "/home/tpu-runtime/tpu-env is missing"}, "tpu-env", "is missing"),
    ],
)
def test_each_wrong_identity_is_its_finding(changes: dict[str, object], name: str, says: str) -> None:
    found = failing(facts(**changes))
    assert name in found, found
    assert says in found[name]


def test_a_complete_multislice_holds() -> None:
    env = {
        **ENV,
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.9:8080",
    }
    assert judge(facts(env=env)).holds


# --- the command line ------------------------------------------------------------------------------


def run(
    root: Root, emu: MetadataEmulator | None, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    host = emu.host if emu is not None else f"127.0.0.1:{free_port()}"  # nothing listens there
    root.path("/tpuboot.yaml").write_text(f"metadata: {{host: '{host}'}}\n")
    code = cli.main(
        [
            "--root",
            str(root.path("/")),
            "--config",
            "/tpuboot.yaml",
            "slice",
            "--timeout",
            "2",
            "--connect-timeout",
            "0.5",
            *args,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("endpoints", "says"),
    [
        ("w0:0:127.0.0.1,:1:127.0.0.2,w2:2:127.0.0.3", "worker-network-endpoints entry 1"),
        ("w0:0:127.0.0.1,w1:1:::1,w2:2:127.0.0.3", "entry 1"),
        ("\x00\x01garbage", "entry 0"),
        (",".join(f"w{i}:{i}:127.0.{i // 256}.{i % 256}" for i in range(10_000)), "10000 entries"),
    ],
)
def test_the_command_says_a_bad_worker_list_in_one_finding(
    root: Root, capsys: pytest.CaptureFixture[str], endpoints: str, says: str
) -> None:
    env = root.path("/home/tpu-runtime/tpu-env")
    env.write_text(render_env_file(ENV))
    attributes = {"agent-worker-number": "1", "worker-network-endpoints": endpoints}
    with MetadataEmulator(
        attributes, instance={"machine-type": MACHINE, "network-interfaces/0/ip": "127.0.0.2"}
    ) as emu:
        code, out, err = run(root, emu, capsys)
    assert code == 1 and err == ""
    (line,) = [line for line in out.splitlines() if line.startswith("FAIL  worker-list")]
    assert says in line and "fix: recreate" in line


def test_a_worker_id_that_is_not_a_number_fails(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    root.path("/home/tpu-runtime/tpu-env").write_text(render_env_file({**ENV, "WORKER_ID": "x1"}))
    with MetadataEmulator({}, instance={"machine-type": MACHINE}) as emu:
        code, out, err = run(root, emu, capsys, "--json")
    assert code == 1 and err == ""
    assert "tpu-env's WORKER_ID 'x1' is not a worker number" in out


def test_a_metadata_server_that_is_down_is_one_line(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    root.path("/home/tpu-runtime/tpu-env").write_text(render_env_file(ENV))
    code, out, err = run(root, None, capsys)
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("tpuboot: metadata server http://127.0.0.1:")
    assert "Traceback" not in err


def test_a_missing_tpu_env_is_a_finding(
    root: Root, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with MetadataEmulator({"agent-worker-number": "0"}, instance={"machine-type": MACHINE}) as emu:
        code, out, _ = run(root, emu, capsys)
    assert code == 1
    assert "FAIL  tpu-env: /home/tpu-runtime/tpu-env is missing" in out


@pytest.mark.parametrize(
    ("endpoints", "own"),
    [
        ("w0:0:127.0.0.1,w\x1b[2J1:1:127.0.0.2\nPASS  forged,w2:2:127.0.0.3", "127.0.0.2"),
        ("w0:0:127.0.0.1,w\x1b]0;owned\x07:1:127.0.0.2,w2:2:127.0.0.3", "127.0.0.9\x1b[31m\nPASS  forged"),
    ],
)
def test_hostile_metadata_cannot_forge_a_line_or_move_the_cursor(
    root: Root, capsys: pytest.CaptureFixture[str], endpoints: str, own: str
) -> None:
    """Escape sequences and newlines in worker-network-endpoints or this host's address come out
    escaped: one line per finding, no control character in the text output."""
    root.path("/home/tpu-runtime/tpu-env").write_text(render_env_file(ENV))
    attributes = {"agent-worker-number": "1", "worker-network-endpoints": endpoints}
    with MetadataEmulator(
        attributes, instance={"machine-type": MACHINE, "network-interfaces/0/ip": own}
    ) as emu:
        code, out, err = run(root, emu, capsys)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert all(line[:4] in ("PASS", "FAIL", "WARN", "SKIP") for line in lines), lines
    assert not [c for c in out if not c.isprintable() and c != "\n"]
    assert "forged" not in "".join(line for line in lines if line.startswith("PASS"))
    assert [line for line in lines if line.startswith("FAIL")], lines
