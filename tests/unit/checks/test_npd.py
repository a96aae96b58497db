"""`tpuboot npd CONDITION` on temporary trees, healthy and not (exit status and a message NPD can
show whole), the unknown answers (exit 2, one line, no traceback), the temporary rule's one event
per reset, and the shipped JSON configs against node-problem-detector's rules for them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.fakes.dockerd import fake_dockerd
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.fakes.proc import FakeProc
from tests.unit.helpers.devices import V5P, add_tpu
from tpuboot import cli
from tpuboot.checks import npd
from tpuboot.checks.doctor import Doctor
from tpuboot.config import Config, EnvConfig, VbarConfig
from tpuboot.devices.reset import BREAKER_PATH
from tpuboot.env.tpuenv import render_env_file
from tpuboot.gce.replies import MetadataAbsent, Reply

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "conf/node-problem-detector"
#: No GKE question: vBar is tpuboot's to run on these trees unless a test says otherwise.
NOT_GKE = "gke: 'false'\n"


ADDRESSES = [f"0000:00:0{4 + i}.0" for i in range(4)]
#: A v5p-8 worker's tpu-env: 4 chips on this host.
TPU_ENV = {"ACCELERATOR_TYPE": "v5p-8", "TOPOLOGY": "2x2x1", "CHIPS_PER_HOST_BOUNDS": "2,2,1",
           "HOST_BOUNDS": "1,1,1", "WORKER_ID": "0"}  # fmt: skip


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return tpu_vm(tmp_path / "root")


def tpu_vm(top: Path) -> FakeKernel:
    """A v5p-8 worker as tpuboot leaves it: 4 chips bound to vfio-pci, its tpu-env written."""
    k = FakeKernel(top)
    k.load_module("vfio-pci")
    for i, address in enumerate(ADDRESSES):
        add_tpu(k, address, V5P, driver="vfio-pci", group=str(4 + i))
    tpu_env = k.p(EnvConfig().tpu_env_path)
    tpu_env.parent.mkdir(parents=True)
    tpu_env.write_text(render_env_file(TPU_ENV))
    (k.top / "etc/tpuboot").mkdir(parents=True, exist_ok=True)
    (k.top / "etc/tpuboot/tpuboot.yaml").write_text(NOT_GKE)
    return k


class Values:
    """A metadata server holding ``values`` (path: text); every other key is absent (404)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, path: str, *, deadline_s: float) -> Reply:
        if path not in self.values:
            raise MetadataAbsent(f"{path}: no such metadata key")
        return Reply(self.values[path].encode(), None)


def run(kernel: FakeKernel, condition: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The command as NPD runs it: its exit status and its stdout, which must be one line NPD
    shows whole (printable ASCII, at most 80 bytes)."""
    status = cli.main(["--root", str(kernel.top), "npd", condition])
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1, out
    line = out[:-1]
    assert len(line.encode()) <= npd.MAX_OUTPUT and line.isascii() and line.isprintable(), line
    return status, line


def daemon_runs(kernel: FakeKernel, pid: int = 321) -> None:
    """tpuboot.service's cgroup holds a live process (how a tree says the daemon runs)."""
    procs = kernel.p("/sys/fs/cgroup/system.slice/tpuboot.service/cgroup.procs")
    procs.parent.mkdir(parents=True, exist_ok=True)
    procs.write_text(f"{pid}\n")
    kernel.p(f"/proc/{pid}").mkdir(parents=True, exist_ok=True)


def test_every_permanent_condition_is_ok_on_a_healthy_tree(kernel, capsys):
    for condition in ("chips", "pcie", "holders"):
        assert run(kernel, condition, capsys)[0] == npd.OK, condition


def test_chips_unbound_or_missing_is_a_problem(kernel, capsys):
    assert run(kernel, "chips", capsys) == (npd.OK, "4 of 4 TPUs bound to vfio-pci")
    kernel.remove_device(ADDRESSES[3])  # tpu-env says v5p-8: 4 chips on this host
    assert run(kernel, "chips", capsys) == (
        npd.PROBLEM,
        "3 chips usable (3 present), CHIPS_PER_HOST_BOUNDS 2,2,1 implies 4",
    )
    kernel.write(kernel.p(f"/sys/bus/pci/devices/{ADDRESSES[1]}/driver/unbind"), ADDRESSES[1])
    status, line = run(kernel, "chips", capsys)
    assert status == npd.PROBLEM and line.startswith(f"1 of 3 TPUs not bound to vfio-pci: {ADDRESSES[1]}")


def test_pcie_lost_fatal_or_degraded_is_a_problem_and_a_doubt_is_not(kernel, capsys):
    device = kernel.p(f"/sys/bus/pci/devices/{ADDRESSES[1]}")
    (device / "aer_dev_nonfatal").write_text("CmpltTO 1\nTOTAL_ERR_NONFATAL 1\n")
    assert run(kernel, "pcie", capsys) == (
        npd.OK,
        f"doubt: {ADDRESSES[1]} logged 1 non-fatal PCIe error(s) since boot",
    )
    (kernel.p(f"/sys/bus/pci/devices/{ADDRESSES[2]}") / "config").write_bytes(b"\xff" * 64)
    status, line = run(kernel, "pcie", capsys)
    assert status == npd.PROBLEM and line.startswith(f"{ADDRESSES[2]} does not answer config reads")


def test_a_chip_held_by_a_stopped_or_zombie_process_is_a_problem(kernel, capsys):
    proc = FakeProc(kernel.top)
    proc.add(100, {4: "/dev/vfio/5"})
    assert run(kernel, "holders", capsys) == (npd.OK, "in use by live processes (chip 1: PID 100)")
    proc.add(101, {4: "/dev/vfio/6"}, state="T")
    status, line = run(kernel, "holders", capsys)
    assert status == npd.PROBLEM and line.startswith("chip 2 held by PID 101 (root, stopped,")
    proc.remove(101)
    proc.add(102, {4: "/dev/vfio/7"}, state="Z", cmdline=[])
    status, line = run(kernel, "holders", capsys)
    assert status == npd.PROBLEM and line.startswith("chip 3 held by PID 102 (root, zombie,")


def vbar(kernel: FakeKernel, config: Config | None = None, **look: object) -> npd.Answer:
    look.setdefault("container_state", lambda root, name: "running")
    look.setdefault("endpoint_probe", lambda endpoint, root: None)
    return npd.judge(kernel.root, config or Config(gke="false"), npd.BY_NAME["vbar"], **look)


def test_vbar_answers_fails_or_is_not_tpubootss_to_run(kernel):
    assert vbar(kernel).status == npd.UNKNOWN  # the daemon that supervises it is not running
    daemon_runs(kernel)
    assert vbar(kernel) == npd.Answer(npd.OK, "container tpuboot-vbar-control-agent is running")
    refused = vbar(kernel, endpoint_probe=lambda endpoint, root: "connection refused")
    assert refused.status == npd.PROBLEM
    assert refused.line == "vBar runs but does not answer at 127.0.0.1:8353 (connection refused)"
    exited = vbar(kernel, container_state=lambda root, name: "exited (exit code 1)")
    assert exited == npd.Answer(npd.PROBLEM, "container tpuboot-vbar-control-agent is exited (exit code 1)")
    on_gke = vbar(kernel, Config(), metadata=Values({"instance/attributes/cluster-name": "c1"}))
    assert on_gke.status == npd.OK and on_gke.message.startswith("not judged here: a GKE node")
    off = vbar(kernel, Config(gke="false", vbar=VbarConfig(enabled=False)))
    assert off == npd.Answer(npd.OK, "not judged here: vbar.enabled is false in the configuration")


def test_the_vbar_rule_asks_dockerd_and_vbars_endpoint_as_on_a_host(capsys):
    """The rule as it runs: dockerd's API over its socket, a connect to vBar's endpoint."""
    name = "tpuboot-vbar-control-agent"
    with fake_dockerd() as dockerd, socket.socket(socket.AF_UNIX) as vbar_socket:
        kernel = tpu_vm(Path(dockerd.root))
        (kernel.top / "etc/tpuboot/tpuboot.yaml").write_text(
            NOT_GKE + "vbar: {endpoint: 'unix:/run/vbar.sock'}\n"
        )
        daemon_runs(kernel)
        vbar_socket.bind(str(kernel.p("/run/vbar.sock")))
        vbar_socket.listen()
        assert run(kernel, "vbar", capsys) == (npd.PROBLEM, f"container {name} does not exist")
        dockerd.add_container(name, "example.invalid/vbar:1")
        assert run(kernel, "vbar", capsys) == (npd.OK, f"container {name} is running")
        vbar_socket.close()
        status, line = run(kernel, "vbar", capsys)
        assert (
            status == npd.PROBLEM
            and line == "vBar runs but does not answer at unix:/run/vbar.sock (connection refused)"
        )
        dockerd.die(name, 1)
        assert run(kernel, "vbar", capsys) == (npd.PROBLEM, f"container {name} is exited (exit code 1)")


def test_vbar_is_unknown_when_nobody_can_tell_whether_this_is_a_gke_node(kernel, capsys):
    (kernel.top / "etc/tpuboot/tpuboot.yaml").write_text("gke: auto\n")
    daemon_runs(kernel)
    status, line = run(kernel, "vbar", capsys)  # under --root no metadata server is asked
    assert status == npd.UNKNOWN and line.startswith("cannot tell: cannot tell whether this is a GKE node")


def test_an_unreadable_root_a_bad_config_or_a_check_that_raises_is_unknown_in_one_line(
    kernel, capsys, monkeypatch, tmp_path
):
    gone = tmp_path / "gone"
    assert cli.main(["--root", str(gone), "npd", "pcie"]) == npd.UNKNOWN
    said = capsys.readouterr().out
    assert said.startswith("--root /") and said.count("\n") == 1 and len(said) <= npd.MAX_OUTPUT + 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["--root", str(empty), "npd", "chips"]) == npd.UNKNOWN
    assert capsys.readouterr().out == "cannot read /sys/bus/pci/devices: No such file or directory\n"
    (kernel.top / "etc/tpuboot/tpuboot.yaml").write_text("vfio: [\n")
    status, line = run(kernel, "chips", capsys)
    assert status == npd.UNKNOWN and "tpuboot.yaml" in line
    (kernel.top / "etc/tpuboot/tpuboot.yaml").write_text(NOT_GKE)

    def broken(self: Doctor) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Doctor, "check_tpus_bound", broken)
    assert cli.main(["--root", str(kernel.top), "npd", "chips"]) == npd.UNKNOWN
    captured = capsys.readouterr()
    assert captured.out == "unexpected OSError: [Errno 5] Input/output error\n"
    assert "Traceback" not in captured.err  # nor on stderr, without --verbose


def test_a_temporary_rule_that_cannot_tell_makes_no_event(kernel, capsys):
    """NPD makes an event of a temporary rule's status 1 and 2 alike: unknown is status 0 there."""
    kernel.p(npd.SEEN_PATH).mkdir(parents=True)  # the record of what was told cannot be read
    record_reset(kernel, "0000:00:05", time.time() - 5)
    status, line = run(kernel, "chip-reset", capsys)
    assert status == npd.OK and line.startswith("unknown: cannot read /var/lib/tpuboot/npd-resets-seen")


def test_an_unknown_condition_is_unknown_and_names_them(kernel, capsys):
    status, line = run(kernel, "gpus", capsys)
    assert status == npd.UNKNOWN
    assert line == "no condition 'gpus': chips, pcie, holders, vbar, maintenance, libtpu, chip-reset"


def test_a_long_or_hostile_message_is_cut_cleanly_to_printable_ascii():
    assert npd.one_line("a\nb\x1b[2Jc\u202e") == "a\\nb\\x1b[2Jc\\u202e"
    long = npd.one_line("x" * 76 + "\x1b" + "y" * 10)
    assert long == "x" * 76 + "..." and len(long) <= npd.MAX_OUTPUT  # the escape is not cut in two
    cut = npd.one_line("é" * 100)
    assert cut.startswith("\\xe9") and cut.endswith("\\xe9...") and len(cut) <= npd.MAX_OUTPUT


def record_reset(kernel: FakeKernel, chip: str, when: float) -> None:
    """A reset as the breaker records it (tpuboot reset and recovery.automatic, before they climb)."""
    path = kernel.p(BREAKER_PATH)
    record = json.loads(path.read_text()) if path.exists() else {}
    record.setdefault(chip, []).append(when)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_each_reset_is_one_event(kernel, capsys):
    assert run(kernel, "chip-reset", capsys) == (npd.OK, "no TPU chip reset since the last look")
    now = time.time()
    record_reset(kernel, "0000:00:05", now - 60)
    status, line = run(kernel, "chip-reset", capsys)
    assert status == npd.PROBLEM
    assert line.startswith("chip 0000:00:05 was reset at ") and line.endswith("recovery.automatic)")
    assert run(kernel, "chip-reset", capsys)[0] == npd.OK  # told once
    record_reset(kernel, "0000:00:05", now - 30)
    record_reset(kernel, "0000:00:06", now - 20)
    status, line = run(kernel, "chip-reset", capsys)
    assert status == npd.PROBLEM
    assert line.startswith("2 resets since the last look") and line.endswith("0000:00:05, 0000:00:06")
    assert run(kernel, "chip-reset", capsys)[0] == npd.OK
    record_reset(kernel, "0000:00:04", now - 7200)  # older than the breaker's hour: not news
    assert run(kernel, "chip-reset", capsys)[0] == npd.OK


# --- the configs, as node-problem-detector's custom plugin monitor reads them ------------------


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def seconds(text: str) -> float:
    assert text.endswith("s") and text[:-1].isdigit(), text
    return float(text[:-1])


def test_the_shipped_configs_are_the_conditions_table():
    files = sorted(p.name for p in CONFIGS.glob("*.json"))
    assert files == sorted(npd.plugin_configs()), "a config that no condition renders"
    for name, data in npd.plugin_configs().items():
        assert load(name) == data, f"conf/node-problem-detector/{name} differs from npd.plugin_configs()"


@pytest.mark.parametrize("name", sorted(npd.plugin_configs()))
def test_a_config_keeps_npd_rules(name):
    config = load(name)
    assert config["plugin"] == "custom"
    plugin = config["pluginConfig"]
    assert plugin["max_output_length"] == npd.MAX_OUTPUT
    declared = [c["type"] for c in config["conditions"]]
    assert len(declared) == len(set(declared)), "a condition declared twice"
    for rule in config["rules"]:
        assert rule["type"] in ("permanent", "temporary")
        if rule["type"] == "permanent":
            assert rule["condition"] in declared
        else:
            assert "condition" not in rule
        assert rule["path"] == npd.TPUBOOT
        assert rule["args"][0] == "npd" and rule["args"][1] in npd.BY_NAME and len(rule["args"]) == 2
        assert seconds(rule["timeout"]) <= seconds(plugin["timeout"])
        assert rule["reason"].isidentifier() and rule["reason"][0].isupper()
    for c in config["conditions"]:
        assert c["type"].startswith("TPU") and c["reason"].isidentifier() and c["message"]
    # NPD's timeout is 5 s and every rule runs every 30 s on every node.
    assert seconds(plugin["timeout"]) <= 5 and seconds(plugin["invoke_interval"]) >= 30


def test_every_shipped_rule_runs_as_npd_runs_it(kernel):
    """Each rule's path and args, as NPD executes them (a process, its stdout, its exit status), on
    the healthy tree: /usr/bin/tpuboot is this tree's `python -m tpuboot`, the root $TPUBOOT_ROOT.
    Every rule is OK there but vBar's and the notice's, unknown: no daemon runs in the tree."""
    expected = {name: npd.OK for name in npd.BY_NAME} | {"vbar": npd.UNKNOWN, "maintenance": npd.UNKNOWN}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TPUBOOT_ROOT": str(kernel.top)}
    for name in sorted(npd.plugin_configs()):
        for rule in load(name)["rules"]:
            assert rule["path"] == npd.TPUBOOT
            done = subprocess.run(
                [sys.executable, "-m", "tpuboot", *rule["args"]],
                capture_output=True,
                env=env,
                cwd=REPO,
                timeout=120,
                check=False,
            )
            assert done.returncode == expected[rule["args"][1]], (rule, done.stdout, done.stderr)
            assert done.stdout.count(b"\n") == 1 and len(done.stdout) <= npd.MAX_OUTPUT + 1, done.stdout


def test_every_condition_is_in_a_config_and_every_type_is_unique():
    rules = [rule for data in npd.plugin_configs().values() for rule in data["rules"]]  # type: ignore[attr-defined]
    assert sorted(rule["args"][1] for rule in rules) == sorted(npd.BY_NAME)
    types = [c.type for c in npd.CONDITIONS if c.kind == "permanent"]
    assert len(types) == len(set(types))


def test_the_docs_table_lists_every_condition():
    text = (REPO / "doc/kubernetes.md").read_text()
    for c in npd.CONDITIONS:
        row = f"| `tpuboot npd {c.name}` | {c.type or 'Event'} | {c.reason} |"
        assert row in text, row


def test_a_maintenance_or_preemption_notice_is_a_problem_and_no_daemon_is_unknown(kernel, capsys):
    """The daemon's /run/tpuboot/notice, as doctor's maintenance-notice reads it: a notice keeps the
    scheduler away; no file while notices are watched: unknown; notices off: not judged."""
    from tpuboot.notices import noticefile
    from tpuboot.notices.parse import MAINTENANCE, PREEMPTED, UPCOMING, Notice, idle

    status, line = run(kernel, "maintenance", capsys)
    assert status == npd.UNKNOWN and "tpuboot run is not running" in line
    noticefile.save(kernel.root, [idle(PREEMPTED), idle(MAINTENANCE), idle(UPCOMING)])
    assert run(kernel, "maintenance", capsys) == (
        npd.OK,
        "no maintenance or preemption notice from the metadata server",
    )
    noticefile.save(kernel.root, [Notice(PREEMPTED, True, "TRUE"), idle(MAINTENANCE), idle(UPCOMING)])
    assert run(kernel, "maintenance", capsys) == (npd.PROBLEM, "the host is going away: preempted TRUE")
    kernel.p(noticefile.NOTICE_PATH).write_text("[garbage")
    assert run(kernel, "maintenance", capsys)[0] == npd.UNKNOWN
    (kernel.top / "etc/tpuboot/tpuboot.yaml").write_text(NOT_GKE + "notices:\n  enabled: false\n")
    assert run(kernel, "maintenance", capsys)[0] == npd.OK
