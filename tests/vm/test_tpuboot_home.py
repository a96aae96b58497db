"""tpu-env when /home/tpu-runtime is a user's home: written at boot, and the user cannot turn it.

The image has a ``tpu-runtime`` user made with ``useradd -m`` before the .deb is installed, its
home mode 0700 (adduser's default on Debian; Ubuntu's useradd gives 0750): tmpfiles.d leaves it as
it is, so tpuboot, root, writes into a directory it does not own and cannot search without
CAP_DAC_OVERRIDE. The user owns the directory and so may replace anything in it; what must hold:
tpuboot writes tpu-env there at boot (root, 0644, readable by the user), never writes anywhere
else whatever the user plants, and neither its daemon nor its watch ends over it. The layout
where tmpfiles.d makes the directory (root's) is tests/vm/test_tpuboot_service.py.

One guest per platform serves the module; each test needs only the boot (the one that plants a
directory clears it again), so ``-k`` runs any one alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import PLATFORMS, Platform, chroot_run
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import READY_STATUS, package_install_hook, put_tpu_env, sourced, status_text

from .conftest import BenchFactory

pytestmark = pytest.mark.vm

USER = "tpu-runtime"
HOME = f"/home/{USER}"
TPU_ENV = f"{HOME}/tpu-env"
VICTIM = "/etc/tpuboot-test/victim"  # a root file the user would like tpuboot to overwrite


def home_user_hook(deb: Path) -> Callable[[Path], None]:
    """The tpu-runtime user and its 0700 home, then the .deb as usual."""
    package = package_install_hook(deb)

    def install(tree: Path) -> None:
        chroot_run(tree, ["useradd", "-m", "-s", "/bin/sh", USER])
        chroot_run(tree, ["chmod", "0700", HOME])
        package(tree)
        victim = tree / VICTIM.lstrip("/")
        victim.write_text("precious\n")
        victim.chmod(0o644)

    return install


@pytest.fixture(scope="module", params=PLATFORMS, ids=lambda p: p.name)
def vm(request: pytest.FixtureRequest, vm_bench: BenchFactory, tpuboot_deb: Path) -> Iterator[VM]:
    platform: Platform = request.param
    image = vm_bench(platform).image(home_user_hook(tpuboot_deb), key="tpuboot-home")
    with VM.from_artifacts(
        vm_bench(platform).artifacts,
        image,
        devices=["edu", "edu", "edu", "virtio-rng-pci"],
        name=f"tpuboot-home-{platform.name}",
    ) as m:
        m.wait_booted()
        yield m


def main_pid(vm: VM) -> str:
    return vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()


def as_user(vm: VM, script: str) -> None:
    vm.run(["sh", "-c", script], user=USER, check=True)


def stat(vm: VM, path: str) -> str:
    return vm.run(["stat", "-c", "%a %U %F", path], check=True).stdout.strip()


def test_tpu_env_is_written_at_boot_into_the_users_home(vm: VM) -> None:
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert status_text(vm) == READY_STATUS
    assert stat(vm, HOME) == f"700 {USER} directory"  # left as it was
    assert stat(vm, TPU_ENV) == "644 root regular file"
    script = f"set -a; . {TPU_ENV}; env -0"
    out = vm.run(["env", "-i", "sh", "-c", script], user=USER, check=True).stdout_bytes
    pairs = (item.decode().split("=", 1) for item in out.split(b"\0") if item)
    assert {k: v for k, v in pairs if k not in ("PWD", "SHLVL", "_")} == SAMPLE_TPU_ENV


def test_the_service_sees_no_home_but_this_one(vm: VM) -> None:
    seen = vm.run(["nsenter", "-t", main_pid(vm), "-m", "ls", "-A", "/home"], check=True).stdout.split()
    assert seen == [USER]


def test_a_symlink_the_user_plants_is_replaced_not_written_through(vm: VM) -> None:
    pid = main_pid(vm)
    as_user(vm, f"ln -sfn {VICTIM} {TPU_ENV}")
    values = {"WORKER_ID": "7"}
    put_tpu_env(vm, values)
    vm.wait_until(f"[ ! -L {TPU_ENV} ] && grep -q WORKER_ID=.7. {TPU_ENV}", timeout=20)
    assert vm.read_file(VICTIM) == b"precious\n"
    assert stat(vm, TPU_ENV) == "644 root regular file"
    assert sourced(vm, "sh", TPU_ENV) == values
    assert main_pid(vm) == pid


def test_a_directory_in_the_way_fails_that_write_only(vm: VM) -> None:
    pid = main_pid(vm)
    as_user(vm, f"rm -f {TPU_ENV} && mkdir {TPU_ENV} && ln -s {VICTIM} {TPU_ENV}/x")
    put_tpu_env(vm, {"WORKER_ID": "8"})
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'tpu-env: cannot write'", timeout=20)
    status = status_text(vm)
    assert f"cannot write {TPU_ENV}: a directory is in the way; remove it" in status, status
    assert vm.read_file(VICTIM) == b"precious\n"
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert main_pid(vm) == pid
    # The user clears it: the next change is written.
    as_user(vm, f"rm -r {TPU_ENV}")
    put_tpu_env(vm, SAMPLE_TPU_ENV)
    vm.wait_until(f"grep -q '^ZONE=' {TPU_ENV}", timeout=20)
    assert stat(vm, TPU_ENV) == "644 root regular file"
    assert main_pid(vm) == pid
    assert sourced(vm, "sh", TPU_ENV) == SAMPLE_TPU_ENV
