"""vBar supervision on a real kernel with a real dockerd: the packaged service keeps the agent running.

One guest with docker.io serves the module. The vBar stand-in (tpuboot_guest.vbar_install_hook)
is an image made in the guest with ``docker import`` at each dockerd start, tagged as the names
tpu-env gives (``tpuboot-test/vbar:1`` and ``:2``). The first test sees the boot; every other one
starts from the ``running`` fixture (vBar running the allowed image tpu-env names, off GKE), so
``-k`` runs any one alone and a failure does not spread.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    DOCTOR_ENV,
    SCRAPE,
    VBAR_CONTAINER,
    VBAR_IMAGE_1,
    VBAR_IMAGE_2,
    VBAR_LISTENER_PID,
    VBAR_TPU_ENV,
    managed_containers,
    put_tpu_env,
    set_attribute,
    status_text,
    vbar_guest_hook,
    wait_vbar_running,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

NAME, IMAGE_1, IMAGE_2, TPU_ENV = VBAR_CONTAINER, VBAR_IMAGE_1, VBAR_IMAGE_2, VBAR_TPU_ENV
IMAGE_URL = "VBARCONTROL_AGENT_DOCKER_URL"


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(vbar_guest_hook(tpuboot_deb), key="tpuboot-vbar")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="vbar") as m:
        m.wait_booted()
        yield m


@pytest.fixture
def running(vm: VM) -> str:
    """vBar running an allowed image that tpu-env names (the one running, else IMAGE_1), off GKE,
    whatever a test before left: returns that image. One guest command when tpuboot says so."""
    shown = vm.run(
        f"docker inspect -f '{{{{.Config.Image}}}}' {NAME}; systemctl show -P StatusText tpuboot", timeout=60
    ).stdout.splitlines()
    current = shown[0] if len(shown) == 2 else ""
    image = current if current in (IMAGE_1, IMAGE_2) else IMAGE_1
    if current == image and shown[1].endswith("vBar: running"):
        return image
    set_attribute(vm, "cluster-name", None)
    put_tpu_env(vm, {**TPU_ENV, IMAGE_URL: image})
    if "GKE" in status_text(vm):  # GKE is decided at start
        vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    wait_vbar_running(vm, timeout=150)
    return image


def other_image(image: str) -> str:
    return IMAGE_2 if image == IMAGE_1 else IMAGE_1


def inspect(vm: VM, fmt: str) -> str:
    return vm.run(["docker", "inspect", "-f", fmt, NAME], check=True, timeout=60).stdout.strip()


def test_vbar_starts_at_boot_privileged_on_the_host_network(vm: VM) -> None:
    started = time.monotonic()
    wait_vbar_running(vm, timeout=150)
    print(f"vBar running {time.monotonic() - started:.1f} s after the test began")
    assert inspect(vm, "{{.Config.Image}} {{.HostConfig.Privileged}} {{.HostConfig.NetworkMode}}") == (
        f"{IMAGE_1} true host"
    )
    assert len(managed_containers(vm)) == 1
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


def journal_cursor(vm: VM) -> str:
    out = vm.run(["journalctl", "-b", "-u", "tpuboot", "-n", "0", "--show-cursor"], check=True).stdout
    return out.strip().rpartition("-- cursor: ")[2]


def test_a_killed_agent_is_restarted_with_growing_delays(vm: VM, running: str) -> None:
    if "restarting in" in vm.journal("tpuboot"):  # a test before this one had it exit: start afresh
        vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
        wait_vbar_running(vm)
    cursor = journal_cursor(vm)
    ident = inspect(vm, "{{.Id}}")
    took = [kill_and_wait(vm) for _ in range(3)]
    print("restart after docker kill, s:", [f"{t:.1f}" for t in took])
    assert inspect(vm, "{{.Id}}") == ident  # restarted in place, not a second container
    journal = vm.run(
        ["journalctl", "-u", "tpuboot", f"--after-cursor={cursor}", "-o", "cat"], check=True
    ).stdout
    delays = [float(d) for d in re.findall(r"exit 137\)?, restarting in ([0-9.]+) s", journal)]
    assert delays[:3] == [1.0, 2.0, 4.0]
    assert "crash loop (3 exits in a row" in journal
    fields = vm.run("journalctl -b -u tpuboot CONTAINER=" + NAME + " -o cat", check=True).stdout
    assert "crash loop" in fields
    assert took[2] > took[0]


def test_dockerd_restart_is_recovered(vm: VM, running: str) -> None:
    ident = inspect(vm, "{{.Id}}")
    started = time.monotonic()
    vm.run(["systemctl", "restart", "docker"], check=True, timeout=120)
    wait_vbar_running(vm, timeout=90)
    print(f"vBar running again {time.monotonic() - started:.1f} s after systemctl restart docker")
    assert inspect(vm, "{{.Id}}") == ident


def test_tpuboot_restart_keeps_the_same_container(vm: VM, running: str) -> None:
    before = inspect(vm, "{{.Id}} {{.State.StartedAt}}")
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    wait_vbar_running(vm, timeout=60)
    assert inspect(vm, "{{.Id}} {{.State.StartedAt}}") == before  # adopted, never restarted
    assert len(managed_containers(vm)) == 1
    assert "adopted" in vm.journal("tpuboot", lines=30)


def test_an_image_change_in_tpu_env_recreates_the_container(vm: VM, running: str) -> None:
    old = inspect(vm, "{{.Id}}")
    new = other_image(running)
    put_tpu_env(vm, {**TPU_ENV, IMAGE_URL: new})
    vm.wait_until(
        f"docker inspect -f '{{{{.Config.Image}}}}' {NAME} 2>/dev/null | grep -qx {new}", timeout=90
    )
    wait_vbar_running(vm)
    assert inspect(vm, "{{.Id}}") != old
    assert managed_containers(vm) == [inspect(vm, "{{.Id}}")]


def test_the_tpu_env_file_cannot_choose_the_privileged_image(vm: VM, running: str) -> None:
    """Whoever can write /home/tpu-runtime/tpu-env cannot make tpuboot run another image as root."""
    ident = inspect(vm, "{{.Id}}")
    planted = other_image(running)
    vm.run(["sed", "-i", f"s|{running}|{planted}|", "/home/tpu-runtime/tpu-env"], check=True)
    assert planted in vm.run(["cat", "/home/tpu-runtime/tpu-env"], check=True).stdout
    kill_and_wait(vm)
    assert inspect(vm, "{{.Id}} {{.Config.Image}}") == f"{ident} {running}"


def test_an_image_from_a_registry_not_allowed_is_never_pulled_and_the_status_says_why(
    vm: VM, running: str
) -> None:
    put_tpu_env(vm, {**TPU_ENV, IMAGE_URL: "evil.example/vbar:1"})
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'refused: registry'", timeout=60)
    assert status_text(vm).endswith(
        "vBar: image evil.example/vbar:1 refused: registry evil.example not in vbar.registries; "
        "add it there if you trust it"
    )
    assert inspect(vm, "{{.Config.Image}}") == running
    images = vm.run(["docker", "images", "--format", "{{.Repository}}"], check=True).stdout.split()
    assert "evil.example/vbar" not in images


def test_a_running_vbar_that_stops_answering_is_seen_and_restarted(vm: VM, running: str) -> None:
    """The stand-in's listener at 127.0.0.1:8353 (tpuboot's default vbar.endpoint) ends while its
    container runs on: STATUS, the metric and doctor say so within a tick, and the container is
    restarted once unanswered for vbar.restart_unanswered_after (60 s in this guest)."""
    started = inspect(vm, "{{.State.StartedAt}}")
    cursor = journal_cursor(vm)
    answering = 'tpuboot_container_endpoint_up{container="vBar"} 1.0'
    vm.wait_until(f"python3 -c {shlex.quote(SCRAPE)} | grep -qF '{answering}'", timeout=60, interval=2.0)
    end_listener = f"read pid < {VBAR_LISTENER_PID} && kill $pid"
    vm.run(["docker", "exec", NAME, "/bin/sh", "-c", end_listener], check=True, timeout=60)
    refused = "vBar: running, not answering at 127.0.0.1:8353 (connection refused)"
    vm.wait_until(f"systemctl show -P StatusText tpuboot | grep -qF '{refused}'", timeout=60, interval=1.0)
    scrape = vm.run(["python3", "-c", SCRAPE], check=True, timeout=60).stdout
    assert 'tpuboot_container_endpoint_up{container="vBar"} 0.0' in scrape
    assert 'tpuboot_container_up{container="vBar"} 1.0' in scrape
    result = vm.run(["tpuboot", "doctor", "--json"], env=DOCTOR_ENV, timeout=90)
    (endpoint,) = [r for r in json.loads(result.stdout) if r["name"] == "vbar-endpoint"]
    assert (endpoint["status"], endpoint["detail"]) == (
        "FAIL",
        "vBar runs but does not answer at 127.0.0.1:8353 (connection refused)",
    )
    vm.wait_until(
        f"[ \"$(docker inspect -f '{{{{.State.StartedAt}}}}' {NAME})\" != '{started}' ] && "
        "systemctl show -P StatusText tpuboot | grep -q 'vBar: running$'",
        timeout=150,
        interval=1.0,
    )
    journal = vm.run(
        ["journalctl", "-u", "tpuboot", f"--after-cursor={cursor}", "-o", "cat"], check=True
    ).stdout
    assert "vBar: not answering at 127.0.0.1:8353: connection refused" in journal
    restarted = (
        r"vBar: not answering at 127\.0\.0\.1:8353 for (6\d|[7-9]\d) s \(connection refused\); restarting it"
    )
    assert re.search(restarted, journal), journal
    # The new container is probed at the next tick, and answers.
    vm.wait_until(f"python3 -c {shlex.quote(SCRAPE)} | grep -qF '{answering}'", timeout=60, interval=2.0)


def test_on_a_gke_node_nothing_is_started_and_the_status_says_why(vm: VM, running: str) -> None:
    set_attribute(vm, "cluster-name", "tpu-cluster")
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'vBar: not started, GKE node'", timeout=60)
    assert status_text(vm).endswith("vBar: not started, GKE node (GKE runs it)")
    # tpuboot left the container it had started (containers outlive tpuboot); on GKE it starts none.
    vm.run(["docker", "rm", "-f", NAME], check=True, timeout=60)
    time.sleep(5)
    assert managed_containers(vm) == []
    assert "GKE node: instance attribute cluster-name is set" in vm.journal("tpuboot", lines=30)
