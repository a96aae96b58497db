"""tpu-env through systemd's EnvironmentFile= and a real `docker run --env-file`, and the telemetry
collector's configuration inside its container, on one guest with a real dockerd.

tpu-env holds every hostile value (harness/mds_emulator.py HOSTILE_VALUES). systemd itself parses
/run/tpuboot/tpu-env.env for a unit that copies its own /proc/self/environ; docker's CLI parses
/run/tpuboot/tpu-env.docker for a busybox container that prints its /proc/self/environ. The
collector stand-in (tpuboot_guest.COLLECTOR_SCRIPT) prints the config file it finds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV
from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import COLLECTOR_CONFIG, guest_config, stand_in_install_hook, status_text

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

# NONCHAR: systemd's reader would refuse the whole file for it; WRAPPED: docker's meaning of it
# depends on its version (docker/cli pull request 6805). Each is left out of that file alone.
TPU_ENV = {**SAMPLE_TPU_ENV, **HOSTILE_VALUES, "NONCHAR": "a\ufdd0b\U0010ffff", "WRAPPED": '"x"'}
NEWLINE_KEYS = sorted(key for key, value in HOSTILE_VALUES.items() if "\n" in value)
DOCKER_LEFT_OUT = [key for key in TPU_ENV if key in NEWLINE_KEYS or key == "WRAPPED"]
SYSTEMD_FILE = "/run/tpuboot/tpu-env.env"
DOCKER_FILE = "/run/tpuboot/tpu-env.docker"
COLLECTOR = "tpuboot-ai-telemetry-collector"
COLLECTOR_IMAGE = "tpuboot-test/collector:1"
COLLECTOR_YAML = "/etc/tpuboot/collector.yaml"
COLLECTOR_TEXT = "# tpuboot test\ncollection_interval: 30s\nexporters: [prometheus]\n"
DUMP = "/run/tpuboot-test-envdump"
ENVDUMP_UNIT = f"""[Unit]
Description=tpuboot test: the environment systemd gives a unit from tpu-env
After=tpuboot.service

[Service]
Type=oneshot
EnvironmentFile={SYSTEMD_FILE}
ExecStart=/bin/cp /proc/self/environ {DUMP}
"""
CONFIG = guest_config(
    telemetry={
        "enabled": True,
        "image": COLLECTOR_IMAGE,
        "registries": ["docker.io/tpuboot-test"],  # a local name dockerd reads as Docker Hub's
        "config_path": COLLECTOR_YAML,
        "config_target": COLLECTOR_CONFIG,
    },
    supervisor={"backoff_initial": 1, "backoff_max": 8, "stable_after": 60, "pull_retries": 6},
)


def install(deb: Path) -> Callable[[Path], None]:
    return stand_in_install_hook(
        deb,
        CONFIG,
        TPU_ENV,
        {COLLECTOR_IMAGE: "/collector"},
        {COLLECTOR_YAML: COLLECTOR_TEXT, "/etc/systemd/system/tpuboot-test-envdump.service": ENVDUMP_UNIT},
    )


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(install(tpuboot_deb), key="tpuboot-envfiles")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="envfiles") as m:
        m.wait_booted()
        m.wait_until(f"[ -s {DOCKER_FILE} ]", timeout=120, interval=0.5)
        yield m


def environ(data: bytes) -> dict[str, str]:
    """A /proc/PID/environ: NUL-separated NAME=value strings."""
    pairs = (item.partition(b"=") for item in data.split(b"\0") if item)
    return {key.decode(): value.decode() for key, _, value in pairs}


def test_systemd_gives_a_unit_every_value_byte_for_byte(vm: VM) -> None:
    vm.run(["systemctl", "start", "tpuboot-test-envdump.service"], check=True, timeout=60)
    seen = environ(vm.read_file(DUMP))
    carried = {key: value for key, value in TPU_ENV.items() if key != "NONCHAR"}
    assert {key: seen.get(key) for key in carried} == carried
    assert "NONCHAR" not in seen
    assert f"tpu-env: NONCHAR left out of {SYSTEMD_FILE}: NONCHAR holds U+FDD0" in vm.journal("tpuboot")
    mode = vm.run(["stat", "-c", "%U %a", "/run/tpuboot", SYSTEMD_FILE, DOCKER_FILE], check=True)
    assert mode.stdout.split("\n")[:3] == ["root 755", "root 644", "root 644"]


def test_docker_gives_a_container_every_value_it_can_carry_and_tpuboot_names_the_rest(vm: VM) -> None:
    # Readable by a user (the docker CLI reads the file as whoever runs it).
    vm.run(["runuser", "-u", "nobody", "--", "cat", DOCKER_FILE], check=True)
    run = ["docker", "run", "--rm", "--network", "none", "--env-file", DOCKER_FILE, COLLECTOR_IMAGE]
    out = vm.run([*run, "/bin/busybox", "cat", "/proc/self/environ"], check=True, timeout=120)
    seen = environ(out.stdout_bytes)
    carried = {key: value for key, value in TPU_ENV.items() if key not in DOCKER_LEFT_OUT}
    assert {key: seen.get(key) for key in carried} == carried
    assert not set(DOCKER_LEFT_OUT) & set(seen)  # left out whole, never a line read as another variable
    journal = vm.journal("tpuboot")
    assert f"tpu-env: {', '.join(DOCKER_LEFT_OUT)} left out of {DOCKER_FILE}: " in journal


def collector_logs(vm: VM) -> str:
    return vm.run(["docker", "logs", COLLECTOR], check=True, timeout=60).stdout


@pytest.fixture
def collector_up(vm: VM) -> None:
    """The collector started by tpuboot and up (a test run alone comes here straight from the boot)."""
    vm.wait_until(
        f"docker logs {COLLECTOR} 2>/dev/null | grep -q 'collector stand-in up' && "
        "systemctl show -P StatusText tpuboot | grep -q 'telemetry: running'",
        timeout=150,
        interval=0.5,
    )


def test_the_collector_reads_its_config_where_it_was_told(vm: VM, collector_up: None) -> None:
    assert collector_logs(vm) == f"collector config:\n{COLLECTOR_TEXT}collector stand-in up\n"
    binds = vm.run(["docker", "inspect", "-f", "{{json .HostConfig.Binds}}", COLLECTOR], check=True)
    assert binds.stdout.strip() == f'["{COLLECTOR_YAML}:{COLLECTOR_CONFIG}:ro"]'


def test_an_edited_config_reaches_a_new_collector_at_tpuboots_restart(vm: VM, collector_up: None) -> None:
    old = vm.run(["docker", "inspect", "-f", "{{.Id}}", COLLECTOR], check=True).stdout.strip()
    edited = COLLECTOR_TEXT.replace("30s", "60s")
    vm.write_file(COLLECTOR_YAML + ".new", edited)
    vm.run(["mv", COLLECTOR_YAML + ".new", COLLECTOR_YAML], check=True)  # a new inode, as editors do
    started = time.monotonic()
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    vm.wait_until(
        f"docker logs {COLLECTOR} 2>/dev/null | grep -q 60s && "
        "systemctl show -P StatusText tpuboot | grep -q 'telemetry: running'",
        timeout=90,
        interval=0.5,
    )
    print(f"collector recreated {time.monotonic() - started:.1f} s after systemctl restart tpuboot")
    assert vm.run(["docker", "inspect", "-f", "{{.Id}}", COLLECTOR], check=True).stdout.strip() != old
    assert collector_logs(vm) == f"collector config:\n{edited}collector stand-in up\n"


def test_a_missing_config_is_never_bound_and_the_status_says_so(vm: VM, collector_up: None) -> None:
    vm.run(["rm", COLLECTOR_YAML], check=True)
    vm.run(["docker", "kill", COLLECTOR], check=True, timeout=60)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'no such file'", timeout=60)
    status = status_text(vm)
    assert status.endswith(
        f"telemetry: failed: telemetry.config_path {COLLECTOR_YAML}: no such file; create it or unset "
        "telemetry.config_path"
    ), status
    assert vm.run(["test", "-e", COLLECTOR_YAML]).rc != 0  # dockerd made no directory there
