"""Removing the package under a real dockerd: `apt-get remove` stops the service and removes the
privileged container tpuboot started, and only that one; its image stays, after a purge too.

The guest is test_tpuboot_vbar.py's (the same install hook: vBar on, stand-in images imported at
dockerd's start); a container of the admin's from the same image is there to show it is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM

from .conftest import ImageFactory
from .test_tpuboot_vbar import IMAGE_1, NAME, install, managed, wait_running

pytestmark = pytest.mark.vm

ADMINS = "admins-own"


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(install(tpuboot_deb), key="tpuboot-vbar")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="remove") as m:
        m.wait_booted()
        yield m


def names(vm: VM) -> list[str]:
    listed = vm.run(["docker", "ps", "-a", "--format", "{{.Names}}"], check=True, timeout=60)
    return sorted(listed.stdout.split())


def test_remove_takes_tpuboots_container_and_leaves_images_and_other_containers(vm: VM) -> None:
    wait_running(vm, timeout=150)
    vm.run(["docker", "create", "--name", ADMINS, IMAGE_1], check=True, timeout=60)
    assert names(vm) == sorted([ADMINS, NAME]) and len(managed(vm)) == 1

    done = vm.run(["apt-get", "remove", "-y", "tpuboot"], check=True, timeout=300)
    assert f"tpuboot: removed its containers: {NAME} (their images stay" in done.stdout + done.stderr
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "inactive"
    assert names(vm) == [ADMINS] and managed(vm) == []
    vm.run(["docker", "image", "inspect", IMAGE_1], check=True, timeout=60)

    vm.run(["apt-get", "purge", "-y", "tpuboot"], check=True, timeout=300)
    assert names(vm) == [ADMINS]
    vm.run(["docker", "image", "inspect", IMAGE_1], check=True, timeout=60)
