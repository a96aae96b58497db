"""vBar supervision on a real kernel with a real dockerd: the packaged service keeps the agent running.

One guest with docker.io serves the module; the tests run in file order. The vBar stand-in
(tpuboot_guest.vbar_install_hook) is an image made in the guest with ``docker import`` at each
dockerd start, tagged as the names tpu-env gives (``tpuboot-test/vbar:1``, then ``:2``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import MDS_CONTROL, guest_config, vbar_install_hook

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

NAME = "tpuboot-vbar-control-agent"
IMAGE_1 = "tpuboot-test/vbar:1"
IMAGE_2 = "tpuboot-test/vbar:2"
TPU_ENV = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": IMAGE_1}
CONFIG = guest_config(
    # The stand-in images are local names, which dockerd reads as Docker Hub's.
    vbar={"enabled": True, "image": "tpuboot-test/vbar:config", "registries": ["docker.io/tpuboot-test"]},
    supervisor={"backoff_initial": 1, "backoff_max": 8, "stable_after": 60, "pull_retries": 6},
)
PUT_SCRIPT = (
    "import sys, urllib.request; "
    "urllib.request.urlopen(urllib.request.Request(sys.argv[1], sys.argv[2].encode(), method='PUT'))"
)


def install(deb: Path) -> Callable[[Path], None]:
    return vbar_install_hook(deb, CONFIG, TPU_ENV, (IMAGE_1, IMAGE_2))


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(install(tpuboot_deb), key="tpuboot-vbar")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="vbar") as m:
        m.wait_booted()
        yield m


def status_text(vm: VM) -> str:
    return vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"], check=True).stdout.strip()


def inspect(vm: VM, fmt: str) -> str:
    return vm.run(["docker", "inspect", "-f", fmt, NAME], check=True, timeout=60).stdout.strip()


def wait_running(vm: VM, timeout: float = 90.0) -> None:
    vm.wait_until(
        f"[ \"$(docker inspect -f '{{{{.State.Running}}}}' {NAME} 2>/dev/null)\" = true ] && "
        "systemctl show -P StatusText tpuboot | grep -q 'vBar: running'",
        timeout=timeout,
        interval=0.5,
    )


def managed(vm: VM) -> list[str]:
    out = vm.run(["docker", "ps", "-aq", "--no-trunc", "--filter", "label=io.tpuboot.managed=1"], check=True)
    return out.stdout.split()


def test_vbar_starts_at_boot_privileged_on_the_host_network(vm: VM) -> None:
    started = time.monotonic()
    wait_running(vm, timeout=150)
    print(f"vBar running {time.monotonic() - started:.1f} s after the test began")
    assert inspect(vm, "{{.Config.Image}} {{.HostConfig.Privileged}} {{.HostConfig.NetworkMode}}") == (
        f"{IMAGE_1} true host"
    )
    assert len(managed(vm)) == 1
    status = status_text(vm)
    assert "; tpu-env: 14 keys from metadata; " in status
    assert status.endswith("vBar: running")
    # READY did not wait for dockerd: tpuboot is ordered before it.
    assert vm.run("systemctl show -P ActiveEnterTimestampMonotonic tpuboot", check=True).stdout.strip()


def kill_and_wait(vm: VM) -> float:
    before = inspect(vm, "{{.State.StartedAt}}")
    vm.run(["docker", "kill", NAME], check=True, timeout=60)
    killed = time.monotonic()
    vm.wait_until(
        f"[ \"$(docker inspect -f '{{{{.State.StartedAt}}}}' {NAME})\" != '{before}' ] && "
        f"[ \"$(docker inspect -f '{{{{.State.Running}}}}' {NAME})\" = true ]",
        timeout=90,
        interval=0.2,
    )
    return time.monotonic() - killed


def test_a_killed_agent_is_restarted_with_growing_delays(vm: VM) -> None:
    ident = inspect(vm, "{{.Id}}")
    took = [kill_and_wait(vm) for _ in range(3)]
    print("restart after docker kill, s:", [f"{t:.1f}" for t in took])
    assert inspect(vm, "{{.Id}}") == ident  # restarted in place, not a second container
    journal = vm.journal("tpuboot")
    delays = [float(d) for d in re.findall(r"exit 137\)?, restarting in ([0-9.]+) s", journal)]
    assert delays[:3] == [1.0, 2.0, 4.0]
    assert "crash loop (3 exits in a row" in journal
    fields = vm.run("journalctl -b -u tpuboot CONTAINER=" + NAME + " -o cat", check=True).stdout
    assert "crash loop" in fields
    assert took[2] > took[0]


def test_dockerd_restart_is_recovered(vm: VM) -> None:
    ident = inspect(vm, "{{.Id}}")
    started = time.monotonic()
    vm.run(["systemctl", "restart", "docker"], check=True, timeout=120)
    wait_running(vm, timeout=90)
    print(f"vBar running again {time.monotonic() - started:.1f} s after systemctl restart docker")
    assert inspect(vm, "{{.Id}}") == ident


def test_tpuboot_restart_keeps_the_same_container(vm: VM) -> None:
    wait_running(vm)
    before = inspect(vm, "{{.Id}} {{.State.StartedAt}}")
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    wait_running(vm, timeout=60)
    assert inspect(vm, "{{.Id}} {{.State.StartedAt}}") == before  # adopted, never restarted
    assert len(managed(vm)) == 1
    assert "adopted" in vm.journal("tpuboot", lines=30)


def test_an_image_change_in_tpu_env_recreates_the_container(vm: VM) -> None:
    old = inspect(vm, "{{.Id}}")
    values = {**TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": IMAGE_2}
    vm.run(["python3", "-c", PUT_SCRIPT, f"{MDS_CONTROL}/tpu-env", yaml.safe_dump(values)], check=True)
    vm.wait_until(
        f"docker inspect -f '{{{{.Config.Image}}}}' {NAME} 2>/dev/null | grep -qx {IMAGE_2}", timeout=90
    )
    wait_running(vm)
    assert inspect(vm, "{{.Id}}") != old
    assert managed(vm) == [inspect(vm, "{{.Id}}")]


def test_the_tpu_env_file_cannot_choose_the_privileged_image(vm: VM) -> None:
    """Whoever can write /home/tpu-runtime/tpu-env cannot make tpuboot run another image as root."""
    wait_running(vm)
    ident = inspect(vm, "{{.Id}}")
    vm.run(["sed", "-i", f"s|{IMAGE_2}|{IMAGE_1}|", "/home/tpu-runtime/tpu-env"], check=True)
    assert IMAGE_1 in vm.run(["cat", "/home/tpu-runtime/tpu-env"], check=True).stdout
    kill_and_wait(vm)
    assert inspect(vm, "{{.Id}} {{.Config.Image}}") == f"{ident} {IMAGE_2}"


def test_an_image_from_a_registry_not_allowed_is_never_pulled_and_the_status_says_why(vm: VM) -> None:
    values = {**TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": "evil.example/vbar:1"}
    vm.run(["python3", "-c", PUT_SCRIPT, f"{MDS_CONTROL}/tpu-env", yaml.safe_dump(values)], check=True)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'refused: registry'", timeout=60)
    assert status_text(vm).endswith(
        "vBar: image evil.example/vbar:1 refused: registry evil.example not in vbar.registries; "
        "add it there if you trust it"
    )
    assert inspect(vm, "{{.Config.Image}}") == IMAGE_2
    images = vm.run(["docker", "images", "--format", "{{.Repository}}"], check=True).stdout.split()
    assert "evil.example/vbar" not in images


def test_on_a_gke_node_nothing_is_started_and_the_status_says_why(vm: VM) -> None:
    vm.run(["python3", "-c", PUT_SCRIPT, f"{MDS_CONTROL}/cluster-name", "tpu-cluster"], check=True)
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'vBar: not started'", timeout=60)
    assert status_text(vm).endswith("vBar: not started, GKE node (GKE runs it)")
    # tpuboot left the container it had started (containers outlive tpuboot); on GKE it starts none.
    vm.run(["docker", "rm", "-f", NAME], check=True, timeout=60)
    time.sleep(5)
    assert managed(vm) == []
    assert "GKE node: instance attribute cluster-name is set" in vm.journal("tpuboot", lines=30)
