"""tpuboot on a real kernel: the packaged service's boot job, from the .deb.

It binds TPU stand-ins at boot and on hotplug, and writes the runtime environment from the
metadata server emulator running in the guest.

One guest per platform serves the module (Debian 12, then Debian 13 with its own 6.12 kernel,
systemd 257 and Python 3.13: the same .deb installed with apt on both), with 3 edu devices and
a virtio-rng (4 stand-ins), the virtio-blk boot disk (never to be touched) and two empty hotplug
ports. The tests run in file order and each leaves the machine as the next one expects.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator

import pytest
import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import PLATFORMS, TESTER, Platform
from harness.vm.machine import VM, PciDevice
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    MDS_CONTROL,
    VFIO_READ,
    VIRTIO_BLK,
    VIRTIO_RNG,
)
from tpuboot.config import DEFAULT_ENVIRONMENT

from .conftest import BenchFactory, TpubootImages

pytestmark = pytest.mark.vm

TPU_ENV = "/home/tpu-runtime/tpu-env"
# PUT a new value to the emulator's control endpoint from inside the guest (stdlib only).
PUT_SCRIPT = (
    "import sys, urllib.request; "
    "urllib.request.urlopen(urllib.request.Request(sys.argv[1], sys.argv[2].encode(), method='PUT'))"
)
READY_STATUS = "4 TPUs bound to vfio-pci; tpu-env: 14 keys from metadata"


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


def status_text(vm: VM) -> str:
    return vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"], check=True).stdout.strip()


def stand_ins(vm: VM) -> list[PciDevice]:
    return vm.pci_devices(*EDU) + vm.pci_devices(*VIRTIO_RNG)


def node_mode(vm: VM, group: int | None) -> str:
    return vm.run(["stat", "-c", "%a", f"/dev/vfio/{group}"], check=True).stdout.strip()


def vfio_read(vm: VM, address: str) -> str:
    result = vm.run(["python3", VFIO_READ, address], user=TESTER, timeout=30)
    assert result.ok, result.stderr
    return result.stdout.strip()


def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


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
    before = {d.address for d in vm.pci_devices(*EDU)}
    vm.device_add("edu", id="hot0", bus=vm.hotplug_ports[0])

    def new_and_bound() -> bool:
        new = [d for d in vm.pci_devices(*EDU) if d.address not in before]
        return len(new) == 1 and new[0].driver == "vfio-pci"

    wait_for(new_and_bound, timeout=20)
    (new,) = [d for d in vm.pci_devices(*EDU) if d.address not in before]
    assert vfio_read(vm, new.address) == EDU_ID_REGISTER
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q '^5 TPUs bound'", timeout=10)


def test_removal_while_running_is_logged_and_the_daemon_lives(vm: VM) -> None:
    vm.device_del("hot0")
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q '^4 TPUs bound'", timeout=10)
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert "removed" in vm.journal("tpuboot")


def test_cli_rebinds_after_a_manual_unbind(vm: VM) -> None:
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    rc, out, err = tpuboot(vm, "unbind", rng.address)
    assert rc == 0, err
    assert out.strip() == f"{rng.address} released from vfio-pci, now driven by virtio-pci"
    rc, out, err = tpuboot(vm, "bind", rng.address)
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


def sourced(vm: VM, shell: str, path: str) -> dict[str, str]:
    """The variables ``set -a; . FILE`` gives ``shell``, NUL-separated so any value survives."""
    script = f"set -a; . {shlex.quote(path)}; env -0"
    out = vm.run(["env", "-i", shell, "-c", script], check=True).stdout_bytes
    pairs = (item.decode().split("=", 1) for item in out.split(b"\0") if item)
    return {k: v for k, v in pairs if k not in ("PWD", "SHLVL", "_")}


def put_tpu_env(vm: VM, values: dict[str, str]) -> None:
    """Change the tpu-env attribute the guest's metadata emulator serves."""
    vm.run(["python3", "-c", PUT_SCRIPT, f"{MDS_CONTROL}/tpu-env", yaml.safe_dump(values)], check=True)


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
    vm.wait_until(f"grep -q WORKER_ID=.3. {TPU_ENV}", timeout=20)
    assert sourced(vm, "bash", TPU_ENV) == hostile
    assert vm.run(["test", "-e", "/tmp/pwned"]).rc == 1
    assert status_text(vm).endswith("tpu-env: 2 keys from metadata")
    assert vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip() == pid
    # Back to the boot-time value, for the tests after this one.
    put_tpu_env(vm, SAMPLE_TPU_ENV)
    vm.wait_until(f"grep -q '^ZONE=' {TPU_ENV}", timeout=20)


def test_tpu_env_dir_is_roots_and_only_it_of_home_is_seen_by_the_service(vm: VM) -> None:
    """The layout tmpfiles.d makes (tests/vm/test_tpuboot_home.py: a user's home): the directory
    root's 0755, the file readable by another user, and no other home visible to the unit."""
    assert vm.run(["stat", "-c", "%a %U", "/home/tpu-runtime"], check=True).stdout.strip() == "755 root"
    assert vm.run(["sh", "-c", f". {TPU_ENV}; echo $ZONE"], user=TESTER, check=True).stdout.strip()
    pid = vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()
    seen = vm.run(["nsenter", "-t", pid, "-m", "ls", "-A", "/home", "/root"], check=True).stdout.split()
    assert seen == ["/home:", "tpu-runtime", "/root:"]
