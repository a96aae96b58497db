"""tpuboot on a real kernel: the packaged service's boot job, from the .deb.

It binds TPU stand-ins at boot and on hotplug, and writes the runtime environment from the
metadata server emulator running in the guest.

One guest per platform serves the module (Debian 12, then Debian 13 with its own 6.12 kernel,
systemd 257 and Python 3.13: the same .deb installed with apt on both), with 3 edu devices and
a virtio-rng (4 stand-ins), the virtio-blk boot disk (never to be touched) and two empty hotplug
ports. Each test starts from the boot state (4 stand-ins bound, SAMPLE_TPU_ENV) and puts back
what it changes even when it fails, so ``-k`` runs any one alone and a failure does not spread.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import PLATFORMS, TESTER, Platform
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    READY_STATUS,
    VIRTIO_BLK,
    VIRTIO_RNG,
    hotplug_edu,
    node_mode,
    put_tpu_env,
    sourced,
    stand_ins,
    status_text,
    unplug,
    vfio_read,
)
from tpuboot.config import DEFAULT_ENVIRONMENT

from .conftest import BenchFactory, TpubootImages

pytestmark = pytest.mark.vm

TPU_ENV = "/home/tpu-runtime/tpu-env"


@pytest.fixture(scope="module", params=PLATFORMS, ids=lambda p: p.name)
def vm(request: pytest.FixtureRequest, vm_bench: BenchFactory, tpuboot_images: TpubootImages) -> Iterator[VM]:
    platform: Platform = request.param
    devices = ["edu", "edu", "edu", "virtio-rng-pci"]
    with VM.from_artifacts(
        vm_bench(platform).artifacts,
        tpuboot_images(platform),
        devices=devices,
        hotplug_ports=2,
        name=f"tpuboot-{platform.name}",
    ) as m:
        m.wait_booted()
        yield m


def tpuboot(vm: VM, *args: str) -> tuple[int, str, str]:
    result = vm.run(["tpuboot", *args], timeout=60)
    return result.rc, result.stdout, result.stderr


def test_service_is_active_with_its_status_line(vm: VM) -> None:
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert status_text(vm) == READY_STATUS
    shown = vm.run(["systemctl", "status", "--no-pager", "tpuboot"]).stdout
    assert f'Status: "{READY_STATUS}"' in shown


def test_coldplug_binds_all_four_stand_ins(vm: VM) -> None:
    devices = stand_ins(vm)
    assert len(devices) == 4
    assert [d.driver for d in devices] == ["vfio-pci"] * 4
    assert [node_mode(vm, d.iommu_group) for d in devices] == ["666"] * 4
    unsafe = vm.read_file("/sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts")
    assert unsafe.strip() == b"Y"


def test_virtio_rng_went_through_the_unbind_path(vm: VM) -> None:
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    entries = vm.run(["journalctl", "-b", "-u", "tpuboot", "-o", "json", f"DBDF={rng.address}"], check=True)
    messages = [json.loads(line)["MESSAGE"] for line in entries.stdout.splitlines()]
    assert f"{rng.address}: unbinding from virtio-pci" in messages
    assert any(m.startswith(f"{rng.address} (virtio-rng stand-in) bound to vfio-pci") for m in messages)


def test_boot_disk_is_left_alone(vm: VM) -> None:
    (disk,) = vm.pci_devices(*VIRTIO_BLK)
    assert disk.driver == "virtio-pci"
    override = vm.read_file(f"/sys/bus/pci/devices/{disk.address}/driver_override")
    assert override.strip() == b"(null)"


def test_unprivileged_user_reads_the_device_through_vfio(vm: VM) -> None:
    for edu in vm.pci_devices(*EDU):
        assert vfio_read(vm, edu.address) == EDU_ID_REGISTER


def test_hotplugged_device_is_bound_and_usable(vm: VM) -> None:
    new = hotplug_edu(vm, "hot0", 0)
    try:
        assert vfio_read(vm, new.address) == EDU_ID_REGISTER
        vm.wait_until("systemctl show -P StatusText tpuboot | grep -q '^5 TPUs bound'", timeout=10)
    finally:
        unplug(vm, "hot0", 4)  # back to the 4 stand-ins the tests after this one count


def test_removal_while_running_is_logged_and_the_daemon_lives(vm: VM) -> None:
    hot = hotplug_edu(vm, "hot1", 1)
    unplug(vm, "hot1", 4)
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert f"{hot.address} (edu stand-in) removed" in vm.journal("tpuboot")


def test_cli_rebinds_after_a_manual_unbind(vm: VM) -> None:
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    rc, out, err = tpuboot(vm, "unbind", rng.address)
    try:
        assert rc == 0, err
        assert out.strip() == f"{rng.address} released from vfio-pci, now driven by virtio-pci"
    finally:
        rc, out, err = tpuboot(vm, "bind", rng.address)  # bound again whatever failed above
    assert rc == 0, err
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    assert rng.driver == "vfio-pci"
    assert out.startswith(f"{rng.address} (virtio-rng stand-in) bound to vfio-pci, /dev/vfio/")
    assert node_mode(vm, rng.iommu_group) == "666"
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"


def test_cli_refuses_the_boot_disk_in_one_line(vm: VM) -> None:
    (disk,) = vm.pci_devices(*VIRTIO_BLK)
    rc, _, err = tpuboot(vm, "bind", disk.address)
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert "not a TPU and is driven by virtio-pci" in err and "--force" in err
    (disk,) = vm.pci_devices(*VIRTIO_BLK)
    assert disk.driver == "virtio-pci"


def test_cli_rejects_a_malformed_address(vm: VM) -> None:
    rc, _, err = tpuboot(vm, "bind", "0000:00:04x0")
    assert rc == 2
    assert "write it as dddd:bb:dd.f" in err


def test_status_json_describes_every_stand_in(vm: VM) -> None:
    rc, out, err = tpuboot(vm, "status", "--json")
    assert rc == 0, err
    tpus = json.loads(out)
    assert len(tpus) == 4
    assert all(t["driver"] == "vfio-pci" and t["node_mode"] == "0666" and t["viable"] for t in tpus)


def test_restart_is_idempotent(vm: VM) -> None:
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=90)
    assert status_text(vm) == READY_STATUS
    assert "already bound to vfio-pci" in vm.journal("tpuboot", lines=20)


def test_tpu_env_written_at_boot_sources_to_the_metadata_values(vm: VM) -> None:
    for shell in ("sh", "bash"):
        assert sourced(vm, shell, TPU_ENV) == SAMPLE_TPU_ENV
    assert vm.run(["stat", "-c", "%a %U", TPU_ENV], check=True).stdout.strip() == "644 root"


def test_etc_environment_has_each_key_once(vm: VM) -> None:
    lines = vm.read_file("/etc/environment").decode().splitlines()
    for key, value in DEFAULT_ENVIRONMENT.items():
        assert [line for line in lines if line.startswith(f"{key}=")] == [f"{key}={value}"]


def test_a_tpu_env_change_is_picked_up_without_restart(vm: VM) -> None:
    pid = vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()
    hostile = {"WORKER_ID": "3", "INJECT": '$(touch /tmp/pwned) `id` "q" \\ end'}
    put_tpu_env(vm, hostile)
    try:
        vm.wait_until(f"grep -q WORKER_ID=.3. {TPU_ENV}", timeout=20)
        assert sourced(vm, "bash", TPU_ENV) == hostile
        assert vm.run(["test", "-e", "/tmp/pwned"]).rc == 1
        assert status_text(vm).endswith("tpu-env: 2 keys from metadata")
        assert vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip() == pid
    finally:
        # Back to the boot-time value, for the tests after this one.
        put_tpu_env(vm, SAMPLE_TPU_ENV)
        vm.wait_until(f"grep -q '^ZONE=' {TPU_ENV}", timeout=20)


def test_tpu_env_dir_is_roots_and_only_it_of_home_is_seen_by_the_service(vm: VM) -> None:
    """The layout tmpfiles.d makes (test_tpuboot_home.py: a user's home): the directory
    root's 0755, the file readable by another user, and no other home visible to the unit."""
    assert vm.run(["stat", "-c", "%a %U", "/home/tpu-runtime"], check=True).stdout.strip() == "755 root"
    assert vm.run(["sh", "-c", f". {TPU_ENV}; echo $ZONE"], user=TESTER, check=True).stdout.strip()
    pid = vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()
    seen = vm.run(["nsenter", "-t", pid, "-m", "ls", "-A", "/home", "/root"], check=True).stdout.split()
    assert seen == ["/home:", "tpu-runtime", "/root:"]
