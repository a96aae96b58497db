"""vBar's image comes from the tpu-env values tpuboot parsed, never from the tpu-env file.

The file's directory (/home/tpu-runtime) may belong to the runtime user, who can then rewrite the
file or swap it for a symlink; the image of a privileged container must not follow. Each test
plays that user against a fake dockerd and checks the image the supervisor runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from harness.polling import wait_until
from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import engine_of
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.config import Config, EnvConfig
from tpuboot.containers.service import Containers
from tpuboot.env.service import EnvService
from tpuboot.env.sync import EnvSync
from tpuboot.env.tpuenv import render_env_file
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

TPU_ENV = "/home/tpu-runtime/tpu-env"
KEY = "VBARCONTROL_AGENT_DOCKER_URL"
GOOD = "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.2"
NEWER = "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.3"
# In an allowed registry: what stops it here is where the image is read from, not the allowlist.
EVIL = "gcr.io/attacker-project/vbar_control_agent:owned"
NAME = Config().vbar.container_name


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        fake.images.update({GOOD, NEWER, EVIL, Config().vbar.image})
        yield fake


@pytest.fixture
def metadata(emulator: MetadataEmulator) -> MetadataEmulator:
    emulator.set_attribute("tpu-env", tpu_env_yaml({**SAMPLE_TPU_ENV, KEY: GOOD}))
    return emulator


@pytest.fixture
def sync_client(metadata: MetadataEmulator) -> Iterator[MetadataClient]:
    client = make_client(metadata, timeout=0.5)
    yield client
    client.close()


def config_for(emulator: MetadataEmulator) -> Config:
    return make_config(emulator).replace(gke="false")


def agents_for(config: Config, root: Root, dockerd: FakeDockerd, sync: EnvSync | None) -> Containers:
    if sync is None:
        agents = Containers(config, root, None, engine=engine_of(dockerd))
    else:
        agents = Containers(config, root, None, engine=engine_of(dockerd), tpu_env=sync.parsed_values)
    agents.tpu_vm_seen("a TPU is present")
    return agents


def user_rewrites(root: Root, image: str) -> None:
    """What the owner of /home/tpu-runtime can do: replace the file with one of their own."""
    path = root.path(TPU_ENV)
    mine = path.with_name("tpu-env.mine")
    mine.write_text(render_env_file({**SAMPLE_TPU_ENV, KEY: image}))
    os.replace(mine, path)


def user_symlinks(root: Root, image: str, tmp_path: Path) -> None:
    """Or swap it for a symlink to a file they control elsewhere."""
    elsewhere = tmp_path / "user-tpu-env"
    elsewhere.write_text(render_env_file({**SAMPLE_TPU_ENV, KEY: image}))
    path = root.path(TPU_ENV)
    path.unlink()
    path.symlink_to(elsewhere)


def restarted_with(dockerd: FakeDockerd, agents: Containers, streams: int) -> str | None:
    """Kill the container (the supervisor starts it again) and the image it then runs."""
    dockerd.die(NAME, 1)
    wait_until(lambda: len(dockerd.subscribers) > streams and dockerd.running(NAME))
    return dockerd.image_of(NAME)


@pytest.mark.parametrize("how", ["rewrite", "symlink"])
def test_a_user_changing_the_tpu_env_file_cannot_change_the_image(
    how: str, root: Root, dockerd: FakeDockerd, metadata: MetadataEmulator, sync_client: MetadataClient,
    tmp_path: Path,
) -> None:  # fmt: skip
    config = config_for(metadata)
    sync = EnvSync(root, config, sync_client)
    assert sync.sync_once(5).source == "metadata"
    agents = agents_for(config, root, dockerd, sync)
    agents.start(lambda: None)
    try:
        wait_until(lambda: dockerd.image_of(NAME) == GOOD and len(dockerd.subscribers) == 1)
        if how == "rewrite":
            user_rewrites(root, EVIL)
        else:
            user_symlinks(root, EVIL, tmp_path)
        agents.reconfigure()  # as after any tpu-env event: the wanted container is looked at again
        assert restarted_with(dockerd, agents, 1) == GOOD  # and a restart reads no file either
        assert not dockerd.calls("POST", "/containers/create")[1:]  # never recreated
        assert EVIL not in {pull[0] + ":" + pull[1] for pull in dockerd.pulls}
    finally:
        agents.stop()


def test_a_new_value_from_metadata_does_change_the_image(
    root: Root, dockerd: FakeDockerd, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    config = config_for(metadata)
    sync = EnvSync(root, config, sync_client)
    sync.sync_once(5)
    agents = agents_for(config, root, dockerd, sync)
    agents.start(lambda: None)
    try:
        wait_until(lambda: dockerd.image_of(NAME) == GOOD)
        metadata.set_attribute("tpu-env", tpu_env_yaml({**SAMPLE_TPU_ENV, KEY: NEWER}))
        assert sync.sync_once(5).source == "metadata"
        agents.reconfigure()
        wait_until(lambda: dockerd.image_of(NAME) == NEWER)
    finally:
        agents.stop()


@pytest.mark.parametrize("how", ["rewrite", "symlink"])
def test_before_any_sync_the_image_comes_from_the_root_only_cache(
    how: str, root: Root, dockerd: FakeDockerd, metadata: MetadataEmulator, sync_client: MetadataClient,
    tmp_path: Path,
) -> None:  # fmt: skip
    config = config_for(metadata)
    EnvSync(root, config, sync_client).sync_once(5)  # a previous boot: file and cache hold GOOD
    if how == "rewrite":
        user_rewrites(root, EVIL)
    else:
        user_symlinks(root, EVIL, tmp_path)
    booting = EnvSync(root, config, sync_client)  # this boot: vBar starts before the sync ends
    agents = agents_for(config, root, dockerd, booting)
    agents.start(lambda: None)
    try:
        wait_until(lambda: dockerd.image_of(NAME) == GOOD and len(dockerd.subscribers) == 1)
    finally:
        agents.stop()


def test_without_a_sync_or_a_cache_the_image_is_the_configured_one(
    root: Root, dockerd: FakeDockerd, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    config = config_for(metadata)
    root.path(TPU_ENV).write_text(render_env_file({**SAMPLE_TPU_ENV, KEY: EVIL}))
    for sync in (None, EnvSync(root, config, sync_client)):  # env disabled; no cache yet
        agents = agents_for(config, root, dockerd, sync)
        agents.start(lambda: None)
        try:
            wait_until(lambda: dockerd.image_of(NAME) == config.vbar.image)
        finally:
            agents.stop()


def test_parsed_values_are_the_last_good_sync_not_the_file(
    root: Root, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    config = config_for(metadata)
    sync = EnvSync(root, config, sync_client)
    assert sync.parsed_values() is None  # no sync, no cache
    sync.sync_once(5)
    assert (sync.parsed_values() or {})[KEY] == GOOD
    user_rewrites(root, EVIL)
    assert (sync.parsed_values() or {})[KEY] == GOOD
    metadata.set_attribute("tpu-env", "{not: [yaml")  # invalid: the cache is used, and it is GOOD
    assert sync.sync_once(5).source == "cache"
    assert (sync.parsed_values() or {})[KEY] == GOOD
    with pytest.raises(TypeError):
        sync.parsed_values()[KEY] = EVIL  # type: ignore[index]  # read-only for its readers


def test_a_write_that_failed_does_not_change_the_values(
    root: Root, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    """What tpuboot acts on is what it wrote: a value it could not write is not used either."""
    config = config_for(metadata)
    sync = EnvSync(root, config, sync_client)
    sync.sync_once(5)
    metadata.set_attribute("tpu-env", tpu_env_yaml({**SAMPLE_TPU_ENV, KEY: NEWER}))
    root.path(TPU_ENV).unlink()
    root.path(TPU_ENV).mkdir()  # the write fails
    assert sync.sync_once(5).source == "failed"
    assert (sync.parsed_values() or {})[KEY] == GOOD


def test_a_corrupt_cache_gives_no_values(
    root: Root, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    config = config_for(metadata)
    EnvSync(root, config, sync_client).sync_once(5)
    cache = root.path(config.env.cache_dir) / "tpu-env.json"
    cache.write_text("{broken")
    assert EnvSync(root, config, sync_client).parsed_values() is None


def test_the_daemon_wires_the_sync_into_the_containers(
    root: Root, metadata: MetadataEmulator, sync_client: MetadataClient
) -> None:
    """The wiring (tpuboot.wiring.build): the containers read tpu-env from the EnvSync the daemon
    runs, or not at all."""
    from tests.unit.helpers.daemon import QueueMonitor, with_after_boot
    from tpuboot.config import GuestAttributesConfig, MetricsConfig
    from tpuboot.wiring import build

    config = config_for(metadata).replace(
        metrics=MetricsConfig(enabled=False), guest_attributes=GuestAttributesConfig(enabled="false")
    )
    daemon = with_after_boot(build(root, config, monitor=QueueMonitor(), metadata=sync_client))
    env, containers = daemon.part(EnvService), daemon.part(Containers)
    assert env is not None and containers is not None
    env.sync.sync_once(5)
    assert (containers.tpu_env() or {})[KEY] == GOOD
    user_rewrites(root, EVIL)
    assert (containers.tpu_env() or {})[KEY] == GOOD
    disabled = with_after_boot(
        build(root, config.replace(env=EnvConfig(enabled=False)), monitor=QueueMonitor())
    )
    without = disabled.part(Containers)
    assert without is not None and without.tpu_env() is None
    for built in (daemon, disabled):
        built.executor.shutdown()


@pytest.mark.parametrize("change", ["file mode", "file owner", "directory mode", "directory owner"])
def test_a_cache_others_could_write_is_not_used_for_the_image(
    change: str, root: Root, metadata: MetadataEmulator, sync_client: MetadataClient,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    config = config_for(metadata)
    EnvSync(root, config, sync_client).sync_once(5)
    directory = root.path(config.env.cache_dir)
    target = directory if change.startswith("directory") else directory / "tpu-env.json"
    if change.endswith("mode"):
        target.chmod(target.stat().st_mode | 0o002)
    else:
        os.chown(target, 4242, -1)
    booting = EnvSync(root, config, sync_client)
    assert booting.parsed_values() is None and booting.parsed_values() is None
    warnings = [r.getMessage() for r in caplog.records if "not root-only" in r.getMessage()]
    assert len(warnings) == 1 and "chown root and chmod go-w" in warnings[0]
    assert booting.sync_once(5).source == "metadata"  # its own sync still gives it values
    assert (booting.parsed_values() or {})[KEY] == GOOD
