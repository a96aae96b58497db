"""libtpu's runtime metrics on a real kernel: a stand-in job holds the edu stand-in's group node and
serves the runtime metric service on 8431 (harness/runtime_server.py, Debian 12's python3-grpcio);
tpuboot's daemon, under its unit's sandbox, finds it by its next tick, exports its duty cycle and
HBM under GKE's names with the job's unit, and a hang turned on in the job reaches the alert's
metric, doctor, NPD's condition and the journal; the series go with the job."""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import GRPC_BOOKWORM, GUEST_LIBEXEC, in_tree
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import REPO, SCRAPE, guest_config, package_install_hook

from .conftest import BenchFactory

pytestmark = pytest.mark.vm

SERVER = f"{GUEST_LIBEXEC}/runtime_server.py"
UNIT = "tpuboot-test-job"


def install_hook(deb: Path) -> Callable[[Path], None]:
    base = package_install_hook(deb, guest_config())

    def hook(tree: Path) -> None:
        base(tree)
        shutil.copy(REPO / "harness/runtime_server.py", in_tree(tree, SERVER))

    return hook


@pytest.fixture(scope="module")
def vm(vm_bench: BenchFactory, tpuboot_deb: Path) -> Iterator[VM]:
    bench = vm_bench(GRPC_BOOKWORM)
    image = bench.image(install_hook(tpuboot_deb), key="tpuboot-runtime")
    with VM.from_artifacts(bench.artifacts, image, devices=["edu"], memory=1536, name="runtime") as m:
        m.wait_booted()
        yield m


def scrape(vm: VM) -> str:
    return vm.run(["python3", "-c", SCRAPE], check=True, timeout=60).stdout


def wait_scrape(vm: VM, pattern: str, present: bool = True, timeout: float = 150.0) -> None:
    pipeline = f"python3 -c {shlex.quote(SCRAPE)} | grep -q {shlex.quote(pattern)}"
    vm.wait_until(pipeline if present else f"! {pipeline}", timeout=timeout, interval=2.0)


def test_a_stand_in_jobs_metrics_a_hang_and_its_end(vm: VM) -> None:
    report = json.loads(vm.run(["tpuboot", "who", "--json"], timeout=60).stdout)
    (chip,) = [c for c in report["chips"] if c["kind"] == "edu stand-in"]
    (node,) = chip["nodes"]
    assert "duty_cycle{" not in scrape(vm)  # nothing held: nothing polled, no series

    vm.run(["systemd-run", f"--unit={UNIT}", "python3", SERVER, "--port", "8431", "--devices", "2",
            "--hold", node], check=True, timeout=60)  # fmt: skip
    vm.wait_until(f"journalctl -u {UNIT} -o cat | grep -q holding", timeout=60, interval=0.5)
    pid = int(vm.run(["systemctl", "show", "-P", "MainPID", UNIT], check=True).stdout)

    wait_scrape(vm, "duty_cycle{")  # the daemon's next tick (30 s) finds the holder, then polls
    text = scrape(vm)
    labels = f'holder="unit {UNIT}.service",make="cloud-tpu",model="v5p-8",pid="{pid}",tpu_topology="2x2x1"'
    assert f'duty_cycle{{accelerator_id="tpuboot-vm-1",{labels}}} 38.5' in text, text
    assert f'memory_total{{accelerator_id="tpuboot-vm-0",{labels}}} 1.7179869184e+010' in text
    assert (
        f'tpuboot_runtime_hang_detected{{holder="unit {UNIT}.service",pid="{pid}",port="8431"}} 0.0' in text
    )
    top = json.loads(vm.run(["tpuboot", "top", "--json"], check=True, timeout=60).stdout)
    assert [(p["port"], p["pid"], len(p["devices"])) for p in top["ports"]] == [(8431, pid, 2)]

    vm.run(["kill", "-USR1", str(pid)], check=True)  # the job's libtpu reports a hang
    wait_scrape(vm, "tpuboot_runtime_hang_detected{.*} 1.0", timeout=60)
    assert (
        "HANG_DETECTED"
        in vm.run(["journalctl", "-u", "tpuboot", "FAULT=hang", "-o", "cat"], timeout=60).stdout
    )
    verdicts = {v["name"]: v for v in json.loads(vm.run(["tpuboot", "doctor", "--json"], timeout=180).stdout)}
    assert verdicts["libtpu-hang"]["status"] == "FAIL" and f"PID {pid}" in verdicts["libtpu-hang"]["detail"]
    npd = vm.run(["tpuboot", "npd", "libtpu"], timeout=60)
    assert npd.rc == 1 and "hang" in npd.stdout
    assert "libtpu: HANG detected" in vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"]).stdout

    vm.run(["systemctl", "stop", UNIT], check=True, timeout=60)
    wait_scrape(vm, "duty_cycle{", present=False)  # the holder gone: by the next tick
    assert "runtime" not in vm.run(["ls", "/run/tpuboot"], check=True).stdout.split()
