"""A clone never uses its parent's tpu-env cache; the instance that wrote it does (issue 13, item 3).

One guest, booted with QEMU's ``-uuid`` (its SMBIOS system UUID, the kernel's product_uuid). Its
image carries the cache record tpuboot wrote on another instance (made here by tpuboot's own
EnvSync on a tree whose product_uuid is the parent's), as an image captured from a running TPU VM
does. The metadata emulator is installed but not started with tpuboot, so the first boot is the
clone's first boot with the metadata server silent. The cases run in order on that guest:

1. the clone's boot: the parent's record is refused (logged once with the reason), tpu-env is not
   written, STATUS says what it says with no cache;
2. the server answers: the next good fetch writes the clone's tpu-env and replaces the record with
   one naming this instance;
3. the server silent again at a restart: this instance's own record is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from harness.vm.artifacts import Artifacts, in_tree
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    MDS_PORT,
    guest_config,
    install_emulator,
    package_install_hook,
    status_text,
)
from tpuboot.config import Config, EnvConfig, MetadataConfig
from tpuboot.env.cache import cache_path
from tpuboot.env.identity import PRODUCT_UUID_PATH
from tpuboot.env.sync import EnvSync
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

PARENT_UUID = "a1b2c3d4-0000-4000-8000-00000000000a"
CLONE_UUID = "b1b2c3d4-0000-4000-8000-00000000000b"
PARENT_ENV = {**SAMPLE_TPU_ENV, "WORKER_ID": "3"}
CLONE_ENV = {**SAMPLE_TPU_ENV, "WORKER_ID": "5"}
TPU_ENV = EnvConfig().tpu_env_path
CACHE = f"{EnvConfig().cache_dir}/tpu-env.json"
MDS = "tpuboot-test-mds.service"
# The emulator's drop-in without Wants=/After=: tpuboot starts with the metadata server silent.
SILENT_DROP_IN = f"[Service]\nEnvironment=GCE_METADATA_HOST=127.0.0.1:{MDS_PORT}\n"
CONFIG = guest_config(metadata={"boot_deadline": 5})


def parent_record(folder: Path) -> bytes:
    """The cache record tpuboot writes on the parent instance: EnvSync itself, on a tree whose
    product_uuid is PARENT_UUID, fetching the parent's tpu-env from a host-side emulator."""
    top = folder / "parent"
    for directory in ("etc", "home/tpu-runtime", "var/lib/tpuboot", "run/tpuboot", "sys/class/dmi/id"):
        (top / directory).mkdir(parents=True, exist_ok=True)
    (top / PRODUCT_UUID_PATH.lstrip("/")).write_text(PARENT_UUID + "\n")
    root = Root(top)
    with MetadataEmulator({"tpu-env": tpu_env_yaml(PARENT_ENV)}) as emu:
        config = Config(metadata=MetadataConfig(host=emu.host), env=EnvConfig())
        client = MetadataClient(emu.url, timeout=5.0)
        try:
            result = EnvSync(root, config, client).sync_once(10.0)
        finally:
            client.close()
    assert result.source == "metadata", result.status
    data = root.path(cache_path(config)).read_bytes()
    assert json.loads(data)["product_uuid"] == PARENT_UUID
    return data


def install(deb: Path, record: bytes) -> Callable[[Path], None]:
    base = package_install_hook(deb, CONFIG)

    def hook(tree: Path) -> None:
        base(tree)
        install_emulator(tree, CLONE_ENV)
        in_tree(tree, f"/etc/systemd/system/multi-user.target.wants/{MDS}").unlink()
        in_tree(tree, "/etc/systemd/system/tpuboot.service.d/test-metadata.conf").write_text(SILENT_DROP_IN)
        cache = in_tree(tree, CACHE)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(record)
        os.chmod(cache, 0o600)

    return hook


@pytest.fixture(scope="module")
def vm(
    vm_artifacts: Artifacts,
    vm_image_factory: ImageFactory,
    tpuboot_deb: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VM]:
    record = parent_record(tmp_path_factory.mktemp("clone"))
    image = vm_image_factory(install(tpuboot_deb, record), key="tpuboot-clone")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], uuid=CLONE_UUID, name="clone") as m:
        m.wait_booted()
        yield m


def record(vm: VM) -> dict[str, object]:
    data: dict[str, object] = json.loads(vm.read_file(CACHE))
    return data


def test_a_clone_booting_with_the_metadata_server_silent_does_not_use_its_parents_cache(vm: VM) -> None:
    assert vm.read_file(PRODUCT_UUID_PATH).decode().strip().lower() == CLONE_UUID  # -uuid reached the guest
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'tpu-env: metadata server'", timeout=180)
    assert (
        f"tpu-env: metadata server unreachable and no cached copy; left {TPU_ENV} as it was"
        in status_text(vm)
    )
    assert vm.run(["test", "-e", TPU_ENV]).rc == 1  # the parent's WORKER_ID was not written
    journal = vm.journal("tpuboot")
    reason = f"belongs to another instance (system UUID {PARENT_UUID}, this one is {CLONE_UUID}"
    assert journal.count(reason) == 1, journal
    assert record(vm)["product_uuid"] == PARENT_UUID  # left for the next good fetch to replace


def good_fetch(vm: VM) -> None:
    """The metadata server answers again and tpuboot restarts: a fetch that writes the cache."""
    vm.run(["systemctl", "start", MDS], check=True, timeout=60)
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)


def test_the_next_good_fetch_replaces_the_parents_record(vm: VM) -> None:
    good_fetch(vm)
    assert "keys from metadata" in status_text(vm)
    assert 'WORKER_ID="5"' in vm.read_file(TPU_ENV).decode().splitlines()
    written = record(vm)
    assert written["product_uuid"] == CLONE_UUID
    assert written["tpu_env"] == tpu_env_yaml(CLONE_ENV)


def test_the_same_instance_uses_its_own_cache_when_the_server_is_silent(vm: VM) -> None:
    if record(vm)["product_uuid"] != CLONE_UUID:  # run alone: the cache still holds the parent's
        good_fetch(vm)
    vm.run(["systemctl", "stop", "tpuboot", MDS], check=True, timeout=60)
    vm.run(["rm", "-f", TPU_ENV], check=True)
    vm.run(["systemctl", "start", "tpuboot"], check=True, timeout=120)
    assert "tpu-env: metadata server unreachable, " in status_text(vm)
    assert " keys from cache of " in status_text(vm)
    assert 'WORKER_ID="5"' in vm.read_file(TPU_ENV).decode().splitlines()
