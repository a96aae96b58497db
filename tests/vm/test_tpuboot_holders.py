"""Who holds the TPU, on a real kernel: real holders of a stand-in's /dev/vfio/N in one guest.

The guest is the vBar module's image (tpuboot from the .deb, the edu stand-in bound to vfio-pci,
docker.io with the busybox stand-in images). A process of another user (``tester``, in a
systemd-run unit with a 64 KiB memlock limit) opens the group node, which VFIO lets one process
hold at a time, and takes a lockf() lock on /tmp/libtpu_lockfile as libtpu does; it is then
stopped (SIGSTOP), seen by `who`, `status` and doctor, and ended by `release --kill`. Then
`wait-free` waits for a holder that lets go by itself, and gives up on one that does not; last, a
holder inside a container under dockerd is told by its container id.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.vm.artifacts import GUEST_LIBEXEC, TESTER, Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import SCRAPE, VBAR_IMAGE_1, vbar_guest_hook, wait_vbar_running

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

HOLDER = "/usr/local/bin/tpu-holder"
UNIT = "tpuboot-test-holder"
LOCK = "/tmp/libtpu_lockfile"
# Opens the group node, locks the lock file as libtpu does (0600, lockf), says so, then sleeps.
HOLDER_SCRIPT = """#!/usr/bin/python3
import fcntl, os, sys, time
node = os.open(sys.argv[1], os.O_RDWR)
lock = os.open("/tmp/libtpu_lockfile", os.O_CREAT | os.O_RDWR, 0o600)
fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(vbar_guest_hook(tpuboot_deb), key="tpuboot-vbar")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="holders") as m:
        m.wait_booted()
        m.write_file(HOLDER, HOLDER_SCRIPT, mode=0o755)
        yield m


def who(vm: VM) -> tuple[int, dict[str, Any]]:
    result = vm.run(["tpuboot", "who", "--json"], timeout=60)
    return result.rc, json.loads(result.stdout)


@pytest.fixture(scope="module")
def node(vm: VM) -> str:
    """The edu stand-in's group node."""
    _, report = who(vm)
    (chip,) = [c for c in report["chips"] if c["kind"] == "edu stand-in"]
    (found,) = chip["nodes"]
    return str(found)


def hold(vm: VM, node: str, seconds: int, unit: str = UNIT) -> int:
    """Start a holder as ``tester`` in ``unit``; its PID once it holds the node and the lock."""
    vm.run(
        [
            "systemd-run",
            f"--unit={unit}",
            f"--uid={TESTER}",
            "-p",
            "LimitMEMLOCK=65536",
            HOLDER,
            node,
            str(seconds),
        ],
        check=True,
        timeout=60,
    )
    vm.wait_until(f"journalctl -u {unit} -o cat | grep -q holding", timeout=60, interval=0.2)
    return int(vm.run(["systemctl", "show", "-P", "MainPID", unit], check=True).stdout)


def test_a_stopped_holder_of_another_user_seen_and_ended(vm: VM, node: str) -> None:
    assert who(vm)[0] == 0
    pid = hold(vm, node, 600)
    code, report = who(vm)
    assert code == 1 and report["free"] is False
    (chip,) = [c for c in report["chips"] if c["nodes"] == [node]]
    (holder,) = chip["holders"]
    assert (holder["pid"], holder["user"], holder["state"]) == (pid, TESTER, "sleeping")
    assert holder["unit"] == f"{UNIT}.service" and holder["command"].endswith(f"{node} 600")
    (lock,) = report["locks"]
    assert (lock["path"], lock["owner"], lock["mode"], lock["holder_pid"]) == (LOCK, TESTER, "0600", pid)

    vm.run(["kill", "-STOP", str(pid)], check=True)
    assert f"held by PID {pid} (stopped)" in vm.run(["tpuboot", "status"], timeout=60).stdout
    functions = json.loads(vm.run(["tpuboot", "status", "--json"], timeout=60).stdout)
    (held,) = [f for f in functions if f["node"] == node]
    assert [(h["pid"], h["state"]) for h in held["holders"]] == [(pid, "stopped")]
    # The daemon sees it too, through its sandbox (CAP_SYS_PTRACE, the host's /tmp): its scan is
    # at most 30 s old at a scrape.
    vm.wait_until(
        f"python3 -c {shlex.quote(SCRAPE)} | grep -q 'tpuboot_chip_holders{{.*state=\"stopped\".*}} 1.0'",
        timeout=90,
        interval=2.0,
    )
    scrape = vm.run(["python3", "-c", SCRAPE], check=True, timeout=60).stdout
    assert f'tpuboot_libtpu_lock_held{{path="{LOCK}"}} 1.0' in scrape
    verdicts = {v["name"]: v for v in json.loads(vm.run(["tpuboot", "doctor", "--json"], timeout=180).stdout)}
    assert (
        verdicts["chip-holders"]["status"] == "FAIL"
        and f"kill -CONT {pid}" in verdicts["chip-holders"]["fix"]
    )
    assert verdicts["memlock"]["status"] == "FAIL" and f"holder PID {pid}" in verdicts["memlock"]["detail"]

    kept = vm.run(["tpuboot", "release"], timeout=60)
    assert kept.rc == 1 and f"kept {LOCK}: held by PID {pid}" in kept.stdout
    assert "(--kill ends it)" in kept.stdout
    ended = vm.run(["tpuboot", "release", "--kill"], timeout=60)
    assert f"PID {pid} ended on SIGTERM" in ended.stdout, ended.stdout
    assert ended.rc == 0  # the lock file is left, held by nobody: free
    removed = vm.run(["tpuboot", "release"], timeout=60)
    assert removed.rc == 0 and f"removed {LOCK} (owner {TESTER}, not held)" in removed.stdout
    assert vm.run(["test", "-e", LOCK]).rc == 1


def test_wait_free_waits_for_a_holder_that_lets_go_and_gives_up_on_one_that_does_not(
    vm: VM, node: str
) -> None:
    hold(vm, node, 4, unit=f"{UNIT}-short")
    assert vm.run(["tpuboot", "wait-free", "--timeout", "120"], timeout=180).rc == 0
    assert who(vm)[0] == 0
    pid = hold(vm, node, 600, unit=f"{UNIT}-long")
    late = vm.run(["tpuboot", "wait-free", "--timeout", "2"], timeout=60)
    assert late.rc == 1 and f"PID {pid}" in late.stderr
    vm.run(["systemctl", "stop", f"{UNIT}-long"], check=True, timeout=60)
    vm.run(["tpuboot", "release"], check=True, timeout=60)


def test_a_holder_in_a_container_is_told_by_its_container(vm: VM, node: str) -> None:
    wait_vbar_running(vm, timeout=150)  # vBar's own container runs beside it, and holds nothing
    started = vm.run(
        [
            "docker",
            "run",
            "-d",
            "--network",
            "none",
            "--device",
            node,
            VBAR_IMAGE_1,
            "/bin/sh",
            "-c",
            f"exec 3<>{node}; exec sleep 600",
        ],
        check=True,
        timeout=120,
    )
    container = started.stdout.strip()
    try:
        vm.wait_until("! tpuboot who >/dev/null", timeout=60, interval=0.5)
        _, report = who(vm)
        (holder,) = [h for c in report["chips"] for h in c["holders"]]
        assert (holder["container"], holder["engine"]) == (container, "docker")
        assert holder["namespace_pid"] == 1 and holder["pid_namespace"] is not None  # its own PID namespace
        out = vm.run(["tpuboot", "who"], timeout=60).stdout
        assert f"docker container {container[:12]}" in out
    finally:
        vm.run(["docker", "rm", "-f", container], timeout=120)


# Takes the edu stand-in's device fd the way a VFIO user-space driver does (container, group,
# IOMMU, device), then closes the group's and the container's fds: VFIO lets the device fd live
# on, and it is then the only fd that holds the chip (its link reads anon_inode:[vfio-device]).
DEVICE_FD_HOLDER = f"""import signal, sys
sys.path.insert(0, {GUEST_LIBEXEC!r})
import vfio_read
device = vfio_read.open_device(sys.argv[1])
print("holding", device, flush=True)
signal.pause()
"""


def test_a_chip_held_only_through_a_device_fd_is_never_free(vm: VM, node: str) -> None:
    """Linux 6.1's fdinfo does not name a device fd's device: `who` says held, chip unknown,
    exits 1, and `reset` refuses; once the holder ends, the chip is free."""
    address = next(fn for c in who(vm)[1]["chips"] if c["nodes"] == [node] for fn in c["functions"])
    vm.write_file("/usr/local/bin/tpu-device-holder", DEVICE_FD_HOLDER, mode=0o755)
    vm.run(
        ["systemd-run", "--unit=tpuboot-test-devfd", "python3",
         "/usr/local/bin/tpu-device-holder", address],
        check=True, timeout=60,
    )  # fmt: skip
    try:
        vm.wait_until("journalctl -u tpuboot-test-devfd -o cat | grep -q holding", timeout=60, interval=0.2)
        pid = int(vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot-test-devfd"], check=True).stdout)
        links = vm.run(["sh", "-c", f"ls -l /proc/{pid}/fd"], check=True).stdout
        assert "anon_inode:[vfio-device]" in links and node not in links, links  # the group fd is closed
        code, report = who(vm)
        assert code == 1 and report["free"] is False
        assert [h["pid"] for h in report["unknown_chip_holders"]] == [pid]
        assert all(not c["holders"] for c in report["chips"])  # tied to no chip: it names none
        refused = vm.run(["tpuboot", "reset", address], timeout=120)
        assert refused.rc != 0 and "may be held" in refused.stderr, refused.stderr
    finally:
        vm.run(["systemctl", "stop", "tpuboot-test-devfd"], timeout=60)
    vm.wait_until("tpuboot who >/dev/null", timeout=60, interval=0.5)
