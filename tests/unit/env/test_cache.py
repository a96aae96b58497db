"""The tpu-env cache knows its instance: used only where it was written (issue 13, item 3).

Each test starts from the ``root`` tree of instance INSTANCE_UUID, fills the cache with a good
fetch, then changes what the instance or the record says and boots with the server silent.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from tests.unit.helpers.metadata import INSTANCE_UUID, make_client, make_config
from tpuboot.env.cache import CACHE_FORMAT, CacheState, read_cache
from tpuboot.env.identity import PRODUCT_UUID_PATH, instance_identity
from tpuboot.env.sync import EnvSync
from tpuboot.env.tpuenv import render_env_file
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

TPU_ENV = "/home/tpu-runtime/tpu-env"
CACHE = "/var/lib/tpuboot/tpu-env.json"
OTHER_UUID = "0f0e0d0c-0b0a-4908-8706-050403020100"
NO_CACHE = f"tpu-env: metadata server unreachable and no cached copy; left {TPU_ENV} as it was"


@pytest.fixture
def offline() -> Iterator[MetadataClient]:
    """A client of a metadata server that is gone (connection refused). The port stays bound, not
    listening, for the test's length: a port merely freed could be taken by a server of a test
    running at the same time (pytest-xdist workers, the library-matrix rows)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        client = make_client(MetadataEmulator(port=held.getsockname()[1]), timeout=0.2)  # never started
        yield client
        client.close()


@pytest.fixture
def cached(root: Root, emulator: MetadataEmulator) -> Root:
    """``root`` after a good fetch on this instance: tpu-env and its cache written, then tpu-env
    removed (as on a fresh boot disk) so that only the cache could bring it back."""
    client = make_client(emulator)
    try:
        assert EnvSync(root, make_config(emulator), client).sync_once(5.0).source == "metadata"
    finally:
        client.close()
    root.path(TPU_ENV).unlink()
    return root


def set_uuid(root: Root, text: str | None) -> None:
    path = root.path(PRODUCT_UUID_PATH)
    if text is None:
        path.unlink()
    else:
        path.write_text(text)


def edit_record(root: Root, **fields: object) -> None:
    path = root.path(CACHE)
    record = json.loads(path.read_text())
    for key, value in fields.items():
        if value is ...:
            del record[key]
        else:
            record[key] = value
    path.write_text(json.dumps(record))


def boot_offline(
    root: Root, client: MetadataClient, caplog: pytest.LogCaptureFixture
) -> tuple[str, str, list[str]]:
    """One boot sync with the server silent: its source, status and the cache warnings logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tpuboot.env"):
        result = EnvSync(root, make_config(), client).sync_once(deadline_s=0.3)
    unused = [r.getMessage() for r in caplog.records if "not using it" in r.getMessage()]
    return result.source, result.status, unused


def test_the_record_names_the_instance_that_fetched_it(cached: Root) -> None:
    record = json.loads(cached.path(CACHE).read_text())
    assert record["format"] == CACHE_FORMAT == 2
    assert record["product_uuid"] == INSTANCE_UUID


def test_the_same_instance_uses_its_cache(
    cached: Root, offline: MetadataClient, caplog: pytest.LogCaptureFixture
) -> None:
    set_uuid(cached, INSTANCE_UUID.upper() + "\n")  # firmware may give it in capitals
    source, status, unused = boot_offline(cached, offline, caplog)
    assert (source, unused) == ("cache", [])
    assert status.startswith("tpu-env: metadata server unreachable, 14 keys from cache of ")
    assert cached.path(TPU_ENV).read_text() == render_env_file(SAMPLE_TPU_ENV)


def test_a_clone_does_not_use_its_parents_cache_and_the_next_fetch_replaces_it(
    cached: Root, offline: MetadataClient, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    set_uuid(cached, OTHER_UUID + "\n")  # the same disk, booted as another instance
    sync = EnvSync(cached, make_config(), offline)
    with caplog.at_level(logging.WARNING, logger="tpuboot.env"):
        result = sync.sync_once(deadline_s=0.3)
        assert sync.parsed_values() is None  # nor is vBar's image taken from it
        assert sync.sync_once(deadline_s=0.3).source == "failed"
    assert (result.source, result.status) == ("failed", NO_CACHE)
    assert not cached.path(TPU_ENV).exists()
    unused = [r.getMessage() for r in caplog.records if "not using it" in r.getMessage()]
    assert unused == [
        f"tpu-env cache {CACHE} belongs to another instance (system UUID {INSTANCE_UUID}, this one is "
        f"{OTHER_UUID}: a disk cloned or moved from it); not using it (the next good fetch from metadata "
        "replaces it)"
    ]
    own = tpu_env_yaml({**SAMPLE_TPU_ENV, "WORKER_ID": "9"})
    emulator.set_attribute("tpu-env", own)
    client = make_client(emulator)
    try:
        assert EnvSync(cached, make_config(emulator), client).sync_once(5.0).source == "metadata"
    finally:
        client.close()
    record = json.loads(cached.path(CACHE).read_text())
    assert record["product_uuid"] == OTHER_UUID
    assert record["tpu_env"] == own
    state = read_cache(cached, make_config())
    assert state.problem is None and state.cached is not None and state.cached.product_uuid == OTHER_UUID


@pytest.mark.parametrize(
    "uuid",
    [
        None,
        "",
        "not a uuid\n",
        "00000000-0000-0000-0000-000000000000\n",
        "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF\n",
    ],
    ids=["absent", "empty", "garbage", "zeros", "ones"],
)
def test_a_machine_without_a_usable_uuid_uses_no_cache(
    cached: Root, offline: MetadataClient, caplog: pytest.LogCaptureFixture, uuid: str | None
) -> None:
    set_uuid(cached, uuid)
    assert instance_identity(cached) is None
    source, status, unused = boot_offline(cached, offline, caplog)
    assert (source, status) == ("failed", NO_CACHE)
    assert len(unused) == 1 and f"no usable system UUID ({PRODUCT_UUID_PATH})" in unused[0]


def test_a_record_of_an_older_tpuboot_is_not_used_and_is_replaced(
    cached: Root, offline: MetadataClient, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    edit_record(cached, format=1, product_uuid=...)  # what tpuboot wrote before it named instances
    source, status, unused = boot_offline(cached, offline, caplog)
    assert (source, status) == ("failed", NO_CACHE)
    assert len(unused) == 1 and "does not name its instance (an older tpuboot wrote it" in unused[0]
    client = make_client(emulator)
    try:
        EnvSync(cached, make_config(emulator), client).sync_once(5.0)
    finally:
        client.close()
    assert json.loads(cached.path(CACHE).read_text())["product_uuid"] == INSTANCE_UUID
    assert boot_offline(cached, offline, caplog)[0] == "cache"


@pytest.mark.parametrize(
    "fields",
    [
        {"product_uuid": 42},
        {"product_uuid": "not-a-uuid"},
        {"product_uuid": INSTANCE_UUID.upper()},  # tpuboot writes it in lower case
        {"tpu_env": 5},
        {"tpu_env": ...},
        {"fetched": None},
        {"etag": ["e"]},
        {"format": "2"},
        {"format": True},
        {"format": 3},
    ],
    ids=repr,
)
def test_a_record_of_the_wrong_shape_is_corrupt_and_ignored_with_one_warning(
    cached: Root, offline: MetadataClient, caplog: pytest.LogCaptureFixture, fields: dict[str, object]
) -> None:
    edit_record(cached, **fields)
    source, status, unused = boot_offline(cached, offline, caplog)
    assert (source, status) == ("failed", NO_CACHE)
    assert unused == [
        f"tpu-env cache {CACHE} is corrupt; not using it (the next good fetch from metadata replaces it)"
    ]


@pytest.mark.parametrize(
    "text", ["[1, 2]", '"text"', "null", "\udcff"], ids=["list", "string", "null", "binary"]
)
def test_a_record_that_is_no_object_is_corrupt(root: Root, text: str) -> None:
    root.path(CACHE).parent.mkdir(parents=True)
    root.path(CACHE).write_bytes(text.encode("utf-8", "surrogateescape"))
    assert read_cache(root, make_config()) == CacheState(None, f"tpu-env cache {CACHE} is corrupt")


def test_no_record_is_no_problem(root: Root) -> None:
    assert read_cache(root, make_config()) == CacheState(None, None)
