"""Removing the package under a real dockerd: `apt-get remove` stops the service and removes the
privileged container tpuboot started, and only that one; its image stays, after a purge too.

The guest is test_tpuboot_vbar.py's (the same install hook, tpuboot_guest.vbar_guest_hook: vBar on,
stand-in images imported at dockerd's start); a container of the admin's from the same image is
there to show it is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    VBAR_CONTAINER,
    VBAR_IMAGE_1,
    managed_containers,
    vbar_guest_hook,
    wait_vbar_running,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

ADMINS = "admins-own"


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(vbar_guest_hook(tpuboot_deb), key="tpuboot-vbar")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="remove") as m:
        m.wait_booted()
        yield m


def names(vm: VM) -> list[str]:
    listed = vm.run(["docker", "ps", "-a", "--format", "{{.Names}}"], check=True, timeout=60)
    return sorted(listed.stdout.split())


def test_remove_takes_tpuboots_container_and_leaves_images_and_other_containers(vm: VM) -> None:
    wait_vbar_running(vm, timeout=150)
    vm.run(["docker", "create", "--name", ADMINS, VBAR_IMAGE_1], check=True, timeout=60)
    assert names(vm) == sorted([ADMINS, VBAR_CONTAINER]) and len(managed_containers(vm)) == 1

    done = vm.run(["apt-get", "remove", "-y", "tpuboot"], check=True, timeout=300)
    assert (
        f"tpuboot: removed its containers: {VBAR_CONTAINER} (their images stay" in done.stdout + done.stderr
    )
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "inactive"
    assert names(vm) == [ADMINS] and managed_containers(vm) == []
    vm.run(["docker", "image", "inspect", VBAR_IMAGE_1], check=True, timeout=60)

    vm.run(["apt-get", "purge", "-y", "tpuboot"], check=True, timeout=300)
    assert names(vm) == [ADMINS]
    vm.run(["docker", "image", "inspect", VBAR_IMAGE_1], check=True, timeout=60)
