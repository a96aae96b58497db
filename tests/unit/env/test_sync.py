"""EnvSync: boot sync from metadata or cache, the fault matrix, and the change watch."""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from harness.mds_emulator import (
    ALIAS_BOMB,
    HOSTILE_VALUES,
    INVALID_YAML,
    SAMPLE_TPU_ENV,
    MetadataEmulator,
    tpu_env_yaml,
)
from harness.polling import wait_until
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.backoff import WATCH_RETRY
from tpuboot.config import DEFAULT_ENVIRONMENT
from tpuboot.env import sync as envsync
from tpuboot.env.results import SyncResult
from tpuboot.env.sync import EnvSync
from tpuboot.env.tpuenv import TpuEnv, render_env_file
from tpuboot.env.watch import watch_tpu_env
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

TPU_ENV = "/home/tpu-runtime/tpu-env"
CACHE = "/var/lib/tpuboot/tpu-env.json"
FETCHED = datetime.datetime(2026, 11, 29, 20, 0, 30, tzinfo=datetime.timezone.utc)
GOOD = render_env_file(SAMPLE_TPU_ENV).encode()


@pytest.fixture
def sync_client(emulator: MetadataEmulator) -> Iterator[MetadataClient]:
    client = make_client(emulator, timeout=0.3)
    yield client
    client.close()


@pytest.fixture
def sync(root: Root, emulator: MetadataEmulator, sync_client: MetadataClient) -> EnvSync:
    return EnvSync(root, make_config(emulator), sync_client, clock=lambda: FETCHED)


def environment_lines(root: Root) -> list[str]:
    return root.path("/etc/environment").read_text().splitlines()


def test_boot_from_metadata_writes_tpu_env_cache_and_environment(
    sync: EnvSync, root: Root, emulator: MetadataEmulator
) -> None:
    result = sync.sync_once(deadline_s=5)
    assert result == SyncResult(
        "metadata",
        14,
        emulator.etag("instance/attributes/tpu-env"),
        "tpu-env: 14 keys from metadata",
        True,
        True,
    )
    assert root.path(TPU_ENV).read_bytes() == GOOD
    assert root.path(TPU_ENV).stat().st_mode & 0o777 == 0o644
    cache = json.loads(root.path(CACHE).read_text())
    assert cache["tpu_env"] == tpu_env_yaml(SAMPLE_TPU_ENV)
    assert cache["etag"] == result.etag
    assert environment_lines(root) == [f"{key}={value}" for key, value in DEFAULT_ENVIRONMENT.items()]


def test_second_boot_rewrites_nothing_visible(sync: EnvSync, root: Root) -> None:
    sync.sync_once(deadline_s=5)
    inodes = (root.path(TPU_ENV).stat().st_ino, root.path("/etc/environment").stat().st_ino)
    again = sync.sync_once(deadline_s=5)
    assert (again.source, again.tpu_env_written, again.environment_written) == ("metadata", False, False)
    assert (root.path(TPU_ENV).stat().st_ino, root.path("/etc/environment").stat().st_ino) == inodes


def test_unreachable_server_writes_tpu_env_from_cache(
    root: Root, emulator: MetadataEmulator, sync_client: MetadataClient
) -> None:
    EnvSync(root, make_config(emulator), sync_client, clock=lambda: FETCHED).sync_once(deadline_s=5)
    root.path(TPU_ENV).unlink()  # a fresh boot disk would not have it either
    emulator.stop()
    result = EnvSync(root, make_config(emulator), sync_client).sync_once(deadline_s=0.5)
    assert result.source == "cache"
    assert result.status == "tpu-env: metadata server unreachable, 14 keys from cache of 2026-11-29T20:00Z"
    assert root.path(TPU_ENV).read_bytes() == GOOD


def test_unreachable_server_and_no_cache_leaves_the_file_alone(
    root: Root, emulator: MetadataEmulator, sync_client: MetadataClient
) -> None:
    root.path(TPU_ENV).write_bytes(b'OLD="1"\n')
    emulator.stop()
    result = EnvSync(root, make_config(emulator), sync_client).sync_once(deadline_s=0.5)
    assert result.source == "failed"
    assert result.status == (
        f"tpu-env: metadata server unreachable and no cached copy; left {TPU_ENV} as it was"
    )
    assert root.path(TPU_ENV).read_bytes() == b'OLD="1"\n'
    assert environment_lines(root)  # /etc/environment does not depend on metadata


def test_absent_attribute_writes_environment_only(
    sync: EnvSync, root: Root, emulator: MetadataEmulator
) -> None:
    emulator.set_attribute("tpu-env", None)
    result = sync.sync_once(deadline_s=5)
    assert (result.source, result.keys, result.etag) == ("absent", 0, None)
    assert result.status == f"tpu-env: no tpu-env attribute in metadata; left {TPU_ENV} as it was"
    assert not root.path(TPU_ENV).exists()
    assert result.environment_written
    assert emulator.request_count == 1


def test_corrupt_cache_is_ignored_with_a_warning(
    root: Root, emulator: MetadataEmulator, sync_client: MetadataClient, caplog: pytest.LogCaptureFixture
) -> None:
    root.path("/var/lib/tpuboot").mkdir(parents=True)
    root.path(CACHE).write_text("{not json")
    emulator.stop()
    with caplog.at_level(logging.WARNING):
        result = EnvSync(root, make_config(emulator), sync_client).sync_once(deadline_s=0.3)
    assert result.source == "failed"
    assert any("is corrupt" in record.getMessage() for record in caplog.records)


def test_bad_environment_config_is_reported_without_stopping_tpu_env(
    root: Root, emulator: MetadataEmulator, sync_client: MetadataClient, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(emulator, environment={"BAD": 'has "quotes"', "GOOD": "1"})
    with caplog.at_level(logging.WARNING):
        result = EnvSync(root, config, sync_client).sync_once(deadline_s=5)
    assert result.source == "metadata"
    assert root.path(TPU_ENV).read_bytes() == GOOD
    # One bad value costs only itself: the other keys are written, and it is named once.
    assert root.path("/etc/environment").read_text() == "GOOD=1\n"
    (warning,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warning.startswith("/etc/environment: left out BAD: env.environment.BAD: the value holds")


def test_hostile_values_are_written_so_the_shell_reads_them_verbatim(
    sync: EnvSync, root: Root, emulator: MetadataEmulator
) -> None:
    emulator.set_attribute("tpu-env", tpu_env_yaml(HOSTILE_VALUES))
    assert sync.sync_once(deadline_s=5).keys == len(HOSTILE_VALUES)
    script = 'set -a; . "$1"; shift; for k do eval "v=\\$$k"; printf "%s\\0" "$v"; done'
    for shell in ("dash", "bash"):
        run = subprocess.run(
            [shell, "-c", script, shell, str(root.path(TPU_ENV)), *HOSTILE_VALUES],
            capture_output=True,
            check=True,
        )
        assert run.stdout.split(b"\0")[:-1] == [v.encode() for v in HOSTILE_VALUES.values()], shell


# --- the fault matrix: each fault ends in a clear log line and an intact tpu-env ---------------

FAULTS = {
    "refused": ({}, "connection refused"),
    "delay": ({"delay": 2.0}, "timed out"),
    "5xx": ({"status": 503}, "HTTP 503"),
    "drop mid-response": ({"drop": True}, "connection dropped"),
    "missing flavor": ({"flavor": None}, "without the Metadata-Flavor: Google header"),
    "wrong flavor": ({"flavor": "Evil"}, "with Metadata-Flavor: 'Evil'"),
    "huge body": ({"body": b"A: " + b"x" * (2 << 20)}, "over 1048576 bytes"),
    "huge body, no length": ({"body": b"A: " + b"x" * (2 << 20), "no_length": True}, "over 1048576 bytes"),
    "redirect": ({"status": 302}, "HTTP 302"),
    "forbidden": ({"status": 403}, "HTTP 403"),
    "invalid YAML": ({"body": INVALID_YAML.encode()}, "tpu-env is not valid YAML (line"),
    "alias bomb": ({"body": ALIAS_BOMB.encode()}, "anchors or aliases"),
    "not a mapping": ({"body": b"- a\n- b\n"}, "not a mapping"),
    "not UTF-8": ({"body": b"A: \xff\xfe\n"}, "not UTF-8"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_leaves_a_clear_log_line_and_an_intact_tpu_env(
    name: str, sync: EnvSync, root: Root, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    faults, message = FAULTS[name]
    sync.sync_once(deadline_s=5)
    root.path(TPU_ENV).unlink()  # must come back from the cache, whole
    if name == "refused":
        emulator.stop()
    else:
        emulator.set_faults(**faults)
    with caplog.at_level(logging.INFO, logger="tpuboot"):
        result = sync.sync_once(deadline_s=0.6)
    assert result.source == "cache"
    assert result.status.startswith("tpu-env: metadata ")
    assert result.status.endswith(", 14 keys from cache of 2026-11-29T20:00Z")
    assert root.path(TPU_ENV).read_bytes() == GOOD
    logged = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert any(message in line for line in logged), logged
    assert any(line == result.status for line in logged)
    assert all("\n" not in line for line in logged)
    cache = json.loads(root.path(CACHE).read_text())
    assert cache["tpu_env"] == tpu_env_yaml(SAMPLE_TPU_ENV)  # a bad value never replaces the good copy


# --- the watch --------------------------------------------------------------------------------


def run_watch(
    sync: EnvSync,
    stop: threading.Event,
    results: list[SyncResult],
    seen: threading.Event,
    retry: tuple[float, float] = WATCH_RETRY,
) -> threading.Thread:
    def on_result(result: SyncResult) -> None:
        results.append(result)
        seen.set()

    worker = threading.Thread(
        target=watch_tpu_env, args=(sync, stop, on_result), kwargs={"retry": retry}, name="watch"
    )
    worker.start()
    return worker


def test_watch_rewrites_tpu_env_on_change_and_stops_promptly(
    sync: EnvSync, sync_client: MetadataClient, root: Root, emulator: MetadataEmulator
) -> None:
    sync.sync_once(deadline_s=5)
    stop, seen, results = threading.Event(), threading.Event(), []
    worker = run_watch(sync, stop, results, seen)
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", tpu_env_yaml({"ACCELERATOR_TYPE": "v5p-16", "WORKER_ID": "1"}))
    assert seen.wait(10)
    assert results[0].source == "metadata"
    assert results[0].status == "tpu-env: 2 keys from metadata"
    assert root.path(TPU_ENV).read_text() == 'ACCELERATOR_TYPE="v5p-16"\nWORKER_ID="1"\n'
    assert emulator.wait_for_pollers(1)  # waiting again, with the new ETag
    stop.set()
    sync_client.close()
    worker.join(timeout=5)
    assert not worker.is_alive()


def test_watch_keeps_the_good_file_when_the_new_value_is_invalid(
    sync: EnvSync, sync_client: MetadataClient, root: Root, emulator: MetadataEmulator
) -> None:
    sync.sync_once(deadline_s=5)
    stop, seen, results = threading.Event(), threading.Event(), []
    worker = run_watch(sync, stop, results, seen)
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", ALIAS_BOMB)
    assert seen.wait(10)
    stop.set()
    sync_client.close()
    worker.join(timeout=5)
    assert results[0].source == "cache"
    assert results[0].status.startswith("tpu-env: metadata tpu-env is invalid, 14 keys from cache of ")
    assert root.path(TPU_ENV).read_bytes() == GOOD


def test_watch_without_a_prior_sync_writes_the_current_value(
    sync: EnvSync, sync_client: MetadataClient, root: Root, emulator: MetadataEmulator
) -> None:
    stop, seen, results = threading.Event(), threading.Event(), []
    worker = run_watch(sync, stop, results, seen)
    assert seen.wait(10)
    stop.set()
    sync_client.close()
    worker.join(timeout=5)
    assert results[0].status == "tpu-env: 14 keys from metadata"
    assert root.path(TPU_ENV).read_bytes() == GOOD


def test_an_attribute_still_unset_is_logged_once_not_again_by_the_watch(
    sync: EnvSync, sync_client: MetadataClient, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    emulator.set_attribute("tpu-env", None)
    with caplog.at_level(logging.INFO, logger="tpuboot"):
        sync.sync_once(deadline_s=5)
        stop, seen, results = threading.Event(), threading.Event(), []
        worker = run_watch(sync, stop, results, seen)
        assert seen.wait(10)  # the watch's first look: still unset
        emulator.set_attribute("tpu-env", tpu_env_yaml({"WORKER_ID": "0"}))
        assert until_len(results, 2)
        stop.set()
        sync_client.close()
        worker.join(timeout=5)
    said = [r.getMessage() for r in caplog.records if r.name == "tpuboot.env.results"]
    assert [s.split(";")[0] for s in said] == [
        "tpu-env: no tpu-env attribute in metadata",
        "tpu-env: 1 key from metadata",
    ]
    assert [r.source for r in results] == ["absent", "metadata"]


def until_len(items: list[SyncResult], n: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while len(items) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(items) >= n


def test_the_lines_tpuboot_wrote_are_recorded_for_the_purge(
    root: Root, emulator: MetadataEmulator, sync_client: MetadataClient
) -> None:
    """Only keys tpuboot changed: one already right belongs to the admin; the latest line wins."""
    record = root.path("/var/lib/tpuboot/environment.lines")
    root.path("/etc/environment").write_text("CLOUDSDK_PYTHON=/usr/bin/python3\nADMIN=1\n")
    EnvSync(root, make_config(emulator), sync_client).sync_once(deadline_s=5)
    first = record.read_text().splitlines()
    assert first == [f"{k}={v}" for k, v in DEFAULT_ENVIRONMENT.items() if k != "CLOUDSDK_PYTHON"]
    assert record.stat().st_mode & 0o777 == 0o600

    changed = {**DEFAULT_ENVIRONMENT, "GCS_RESOLVE_REFRESH_SECS": "30", "EXTRA": "a b"}
    EnvSync(root, make_config(emulator, environment=changed), sync_client).sync_once(deadline_s=5)
    lines = record.read_text().splitlines()
    assert "GCS_RESOLVE_REFRESH_SECS=30" in lines and "GCS_RESOLVE_REFRESH_SECS=60" not in lines
    assert lines[-1] == 'EXTRA="a b"' and len(lines) == len(first) + 1
    mtime = record.stat().st_mtime_ns
    EnvSync(root, make_config(emulator, environment=changed), sync_client).sync_once(deadline_s=5)
    assert record.stat().st_mtime_ns == mtime  # nothing changed: nothing rewritten


# --- documents PyYAML cannot build, and bugs: never the end of a sync or of the watch ----------

UNBUILDABLE = "A: 2026-02-30\nB: !!int ''\nC: " + "9" * 5000 + "\nD: !!timestamp x\n"
UNBUILDABLE_VALUES = 'A="2026-02-30"\nB=""\nC="' + "9" * 5000 + '"\nD="x"\n'


def test_a_document_pyyaml_cannot_build_is_written_as_text_at_boot(
    sync: EnvSync, root: Root, emulator: MetadataEmulator
) -> None:
    """Before: safe_load's ValueError escaped sync_once (`tpuboot env` ended in a traceback)."""
    emulator.set_attribute("tpu-env", UNBUILDABLE)
    result = sync.sync_once(deadline_s=5)
    assert (result.source, result.status) == ("metadata", "tpu-env: 4 keys from metadata")
    assert root.path(TPU_ENV).read_text() == UNBUILDABLE_VALUES


def test_the_watch_writes_a_document_pyyaml_cannot_build_and_then_the_next_one(
    sync: EnvSync, sync_client: MetadataClient, root: Root, emulator: MetadataEmulator
) -> None:
    """Before: the watch thread died on the first, and the second was never written."""
    sync.sync_once(deadline_s=5)
    stop, seen, results = threading.Event(), threading.Event(), []
    worker = run_watch(sync, stop, results, seen)
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", UNBUILDABLE)
    assert until_len(results, 1)
    assert root.path(TPU_ENV).read_text() == UNBUILDABLE_VALUES
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", tpu_env_yaml({"WORKER_ID": "3"}))
    assert until_len(results, 2)
    stop.set()
    sync_client.close()
    worker.join(timeout=5)
    assert [r.source for r in results] == ["metadata", "metadata"]
    assert root.path(TPU_ENV).read_text() == 'WORKER_ID="3"\n'


def fail_on(monkeypatch: pytest.MonkeyPatch, marker: bytes) -> None:
    """Make parsing a metadata value holding ``marker`` raise as a bug would (the cache still parses)."""
    parse = envsync.parse_tpu_env

    def buggy(text: str | bytes, **kwargs: int) -> TpuEnv:
        if isinstance(text, bytes) and marker in text:
            raise RuntimeError("boom\nsecond line")
        return parse(text, **kwargs)

    monkeypatch.setattr(envsync, "parse_tpu_env", buggy)


def test_an_unexpected_exception_at_boot_falls_back_to_the_cache(
    sync: EnvSync, root: Root, emulator: MetadataEmulator, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    sync.sync_once(deadline_s=5)
    root.path(TPU_ENV).unlink()
    fail_on(monkeypatch, b"BOOM")
    emulator.set_attribute("tpu-env", "BOOM: 1\n")
    with caplog.at_level(logging.WARNING, logger="tpuboot"):
        result = sync.sync_once(deadline_s=5)
    assert result.source == "cache"
    assert (
        result.status
        == "tpu-env: unexpected RuntimeError (see the log), 14 keys from cache of 2026-11-29T20:00Z"
    )
    assert root.path(TPU_ENV).read_bytes() == GOOD
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert errors[0].getMessage() == (
        "tpu-env sync: unexpected RuntimeError: boom; this is a bug in tpuboot, please report it"
    )


def test_the_watch_survives_an_unexpected_exception_logs_it_once_and_resumes(
    sync: EnvSync,
    sync_client: MetadataClient,
    root: Root,
    emulator: MetadataEmulator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the exception ended the watch thread for good; later values were never written."""
    sync.sync_once(deadline_s=5)
    fail_on(monkeypatch, b"BOOM")
    stop, seen, results = threading.Event(), threading.Event(), []
    with caplog.at_level(logging.INFO, logger="tpuboot"):
        worker = run_watch(sync, stop, results, seen, retry=(0.05, 0.2))
        assert emulator.wait_for_pollers(1)
        emulator.set_attribute("tpu-env", "BOOM: 1\n")
        assert until_len(results, 1)
        start = emulator.request_count
        deadline = time.monotonic() + 10
        while emulator.request_count < start + 3 and time.monotonic() < deadline:
            time.sleep(0.02)  # it retries, with backoff, the value it failed on
        emulator.set_attribute("tpu-env", tpu_env_yaml({"WORKER_ID": "5"}))
        assert until_len(results, 2)
        stop.set()
        sync_client.close()
        worker.join(timeout=5)
    assert not worker.is_alive()
    assert [r.source for r in results] == ["failed", "metadata"]
    assert results[0].status == f"tpu-env: watch failed (RuntimeError); left {TPU_ENV} as it was"
    assert root.path(TPU_ENV).read_text() == 'WORKER_ID="5"\n'
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # logged once, however many retries
    assert errors[0].exc_info is not None and "\n" not in errors[0].getMessage()
    assert (
        errors[0]
        .getMessage()
        .startswith("tpu-env watch (retrying in 0.05 s): unexpected RuntimeError: boom;")
    )


def test_a_flapping_etag_over_an_unchanged_value_costs_no_line_and_no_rewrite(
    sync: EnvSync,
    sync_client: MetadataClient,
    root: Root,
    emulator: MetadataEmulator,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that gives every answer a new ETag (its long-polls then return at once): nothing
    is news until the value itself changes, and that change still arrives."""
    sync.sync_once(deadline_s=5)
    caplog.clear()
    files = (root.path(TPU_ENV), root.path(CACHE))
    inodes = [path.stat().st_ino for path in files]
    emulator.set_faults(flapping_etag=True)
    stop, seen, results = threading.Event(), threading.Event(), []
    with caplog.at_level(logging.DEBUG, logger="tpuboot"):
        worker = run_watch(sync, stop, results, seen)
        try:
            assert emulator.wait_for_requests(emulator.request_count + 12)  # a dozen new ETags
            quiet = [r for r in caplog.records if r.levelno >= logging.INFO]
            assert [path.stat().st_ino for path in files] == inodes  # neither file rewritten
            emulator.set_attribute("tpu-env", tpu_env_yaml({"WORKER_ID": "3"}))
            wait_until(lambda: any(not r.confirmed for r in results))  # a real change, through the flapping
            changed = [path.stat().st_ino for path in files]
            assert emulator.wait_for_requests(emulator.request_count + 12)
            assert [path.stat().st_ino for path in files] == changed  # and again nothing after it
        finally:
            stop.set()
            sync_client.close()
            worker.join(timeout=5)
    assert quiet == [], [r.getMessage() for r in quiet]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["tpu-env: 1 key from metadata"]
    assert root.path(TPU_ENV).read_text() == 'WORKER_ID="3"\n'
