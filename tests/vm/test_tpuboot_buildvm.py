"""An image-building VM: tpuboot installed where there is no TPU and no tpu-env (a Packer or
cloud-init build instance, off GKE, with dockerd) runs no privileged container and pulls nothing
into the image; once tpu-env appears, it is a TPU VM and vBar starts.

The guest is test_tpuboot_vbar.py's (tpuboot_guest.vbar_guest_hook), booted without stand-in TPUs,
with a metadata server that answers as on an ordinary VM: no tpu-env attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts, in_tree
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    VBAR_TPU_ENV,
    managed_containers,
    put_tpu_env,
    status_text,
    vbar_guest_hook,
    wait_vbar_running,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    vbar_guest = vbar_guest_hook(tpuboot_deb)

    def ordinary_vm(tree: Path) -> None:
        vbar_guest(tree)
        in_tree(tree, "/etc/tpuboot-test/attributes.yaml").write_text("{}\n")  # no tpu-env

    image = vm_image_factory(ordinary_vm, key="tpuboot-buildvm")
    with VM.from_artifacts(vm_artifacts, image, memory=1536, name="buildvm") as m:
        m.wait_booted()
        yield m


def test_no_tpu_and_no_tpu_env_runs_no_container(vm: VM) -> None:
    vm.wait_until(
        "systemctl show -P StatusText tpuboot | grep -q 'vBar: not started, not a TPU VM'", timeout=60
    )
    assert status_text(vm).endswith("vBar: not started, not a TPU VM (no TPU present, no tpu-env)")
    vm.wait_until("systemctl is-active -q docker", timeout=120)
    assert managed_containers(vm) == []
    journal = vm.journal("tpuboot")
    assert "not a TPU VM" in journal and "pull" not in journal.lower()


def test_tpu_env_arriving_makes_it_a_tpu_vm_and_vbar_starts(vm: VM) -> None:
    put_tpu_env(vm, VBAR_TPU_ENV)
    wait_vbar_running(vm, timeout=180)
    assert len(managed_containers(vm)) == 1
    assert "a TPU VM (tpu-env is held)" in vm.journal("tpuboot")
