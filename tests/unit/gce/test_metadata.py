"""The metadata client against the emulator: answers, faults, backoff, long-polls, google-auth agreement."""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness import mds_emulator
from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, etag_of, tpu_env_yaml
from tests.unit.helpers.metadata import make_client
from tpuboot.backoff import Backoff
from tpuboot.config import MetadataConfig
from tpuboot.env.tpuenv import parse_tpu_env
from tpuboot.errors import ConfigError, MetadataError, UsageError
from tpuboot.gce.client import MetadataClient
from tpuboot.gce.lookup import metadata_get
from tpuboot.gce.replies import Change, MetadataAbsent, MetadataRefused, MetadataUnanswered
from tpuboot.gce.settings import MIN_POLL_INTERVAL, metadata_base_url
from tpuboot.wiring import metadata_settings

TPU_ENV = "instance/attributes/tpu-env"


# --- where the server is ---------------------------------------------------------------------


def test_default_base_is_the_link_local_address() -> None:
    assert metadata_base_url(None, {}) == "http://169.254.169.254/computeMetadata/v1/"


def test_environment_overrides_config_like_google_auth() -> None:
    assert metadata_base_url("10.0.0.1", {}) == "http://10.0.0.1/computeMetadata/v1/"
    env = {"GCE_METADATA_HOST": "127.0.0.1:8080"}
    assert metadata_base_url("10.0.0.1", env) == "http://127.0.0.1:8080/computeMetadata/v1/"
    assert metadata_base_url(None, {"GCE_METADATA_ROOT": "[::1]:80"}) == "http://[::1]:80/computeMetadata/v1/"


@pytest.mark.parametrize("host", ["http://127.0.0.1", "127.0.0.1/x", "a b", "127.0.0.1:port"])
def test_malformed_host_is_a_config_error(host: str) -> None:
    with pytest.raises(ConfigError, match=r"metadata\.host: .* is not host\[:port\]"):
        metadata_base_url(host, {})
    with pytest.raises(ConfigError, match=r"\$GCE_METADATA_HOST"):
        metadata_base_url(None, {"GCE_METADATA_HOST": host})


def test_from_settings_uses_timeout_and_body_cap() -> None:
    settings = metadata_settings(MetadataConfig(host="127.0.0.1:1", timeout=3.0, max_body=99))
    client = MetadataClient.from_settings(settings, {})
    assert (client.base_url, client.timeout, client.max_body) == (
        "http://127.0.0.1:1/computeMetadata/v1/",
        3.0,
        99,
    )
    client.close()


# --- answers ---------------------------------------------------------------------------------


def test_get_returns_value_and_etag(client: MetadataClient, emulator: MetadataEmulator) -> None:
    reply = client.get(TPU_ENV, deadline_s=5)
    assert reply.text == tpu_env_yaml(SAMPLE_TPU_ENV)
    assert reply.etag == emulator.etag(TPU_ENV)


def test_absent_key_is_a_distinct_answer_and_not_retried(
    client: MetadataClient, emulator: MetadataEmulator
) -> None:
    with pytest.raises(MetadataAbsent, match="no such metadata key"):
        client.get("instance/attributes/nope", deadline_s=5)
    assert emulator.request_count == 1


def test_emulator_requires_the_flavor_header(emulator: MetadataEmulator) -> None:
    plain = requests.get(emulator.url + TPU_ENV, timeout=5)
    assert plain.status_code == 403
    assert plain.headers["Metadata-Flavor"] == "Google"


def test_proxy_variables_are_ignored(client: MetadataClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    assert client.get(TPU_ENV, deadline_s=5).body


def test_transient_errors_are_retried(client: MetadataClient, emulator: MetadataEmulator) -> None:
    emulator.fail_next(3, status=503)
    assert client.get(TPU_ENV, deadline_s=10).body
    assert emulator.request_count == 4


@pytest.mark.parametrize(("status", "text"), [(302, "HTTP 302"), (403, "HTTP 403"), (400, "HTTP 400")])
def test_answers_retrying_cannot_fix_are_not_retried(
    client: MetadataClient, emulator: MetadataEmulator, status: int, text: str
) -> None:
    emulator.set_faults(status=status)
    with pytest.raises(MetadataRefused, match=text):
        client.get(TPU_ENV, deadline_s=5)
    assert emulator.request_count == 1


@pytest.mark.parametrize(
    ("faults", "kind"),
    [
        ({"status": 503}, "HTTP 503"),
        ({"flavor": None}, "without the Metadata-Flavor: Google header"),
        ({"flavor": "Evil"}, "with Metadata-Flavor: 'Evil'"),
        ({"drop": True}, "connection dropped"),
        ({"delay": 3.0}, "timed out"),
    ],
)
def test_failures_end_at_the_deadline_logged_once(
    emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture, faults: dict[str, object], kind: str
) -> None:
    # The client timeout leaves a loaded machine ample time to see a drop as a drop, not a timeout.
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(**faults)
    with (
        caplog.at_level(logging.WARNING, logger="tpuboot.gce"),
        pytest.raises(MetadataError, match=kind),
    ):
        client.get(TPU_ENV, deadline_s=2.0)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    # Once per kind: a loaded machine may add a timeout to the injected kind, but never repeat one.
    assert len(set(warnings)) == len(warnings), warnings
    assert kind in warnings[0], warnings
    assert emulator.request_count >= 2 or faults.get("delay")
    client.close()


def test_connection_refused(emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    emulator.stop()
    with pytest.raises(MetadataError, match="connection refused"):
        client.get(TPU_ENV, deadline_s=0.5)
    client.close()


def test_recovery_is_logged_and_a_new_failure_logged_again(
    client: MetadataClient, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tpuboot.gce"):
        emulator.fail_next(5)
        client.get(TPU_ENV, deadline_s=10)
        emulator.fail_next(2)
        client.get(TPU_ENV, deadline_s=10)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("HTTP 503; retrying" in message for message in messages) == 2
    assert sum("answering again (was: HTTP 503)" in message for message in messages) == 2


def test_oversized_body_is_refused_by_its_declared_length(emulator: MetadataEmulator) -> None:
    client = make_client(emulator, max_body=1000)
    emulator.set_attribute("tpu-env", "A: " + "x" * 2000)
    with pytest.raises(MetadataRefused, match="over 1000 bytes"):
        client.get(TPU_ENV, deadline_s=5)
    assert emulator.request_count == 1
    client.close()


def test_oversized_body_without_length_is_cut_while_streaming(emulator: MetadataEmulator) -> None:
    client = make_client(emulator, max_body=100_000)
    emulator.set_faults(no_length=True, body=b"x" * 5_000_000)
    with pytest.raises(MetadataRefused, match="over 100000 bytes"):
        client.get(TPU_ENV, deadline_s=5)
    client.close()


def test_body_without_length_is_read_to_the_end(client: MetadataClient, emulator: MetadataEmulator) -> None:
    emulator.set_faults(no_length=True)
    assert client.get(TPU_ENV, deadline_s=5).text == tpu_env_yaml(SAMPLE_TPU_ENV)


def test_close_from_another_thread_interrupts_a_blocked_request(emulator: MetadataEmulator) -> None:
    client = make_client(emulator, timeout=30)
    emulator.set_faults(delay=30)
    failure: list[BaseException] = []

    def fetch() -> None:
        try:
            client.get(TPU_ENV, deadline_s=60)
        except MetadataError as exc:
            failure.append(exc)

    worker = threading.Thread(target=fetch)
    worker.start()
    assert emulator.wait_for_requests(1)  # in flight: the server has it and is delaying its answer
    client.close()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert failure and "tpuboot is stopping" in str(failure[0])


def test_backoff_is_full_jitter_above_a_floor_under_an_exponential_cap() -> None:
    backoff = Backoff(initial=0.5, maximum=4.0, floor=0.5)
    rng = random.Random(3)
    for attempt in range(12):
        ceiling = min(4.0, 0.5 * 2**attempt)
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(0.5 <= d <= 0.5 + ceiling for d in delays)
        assert max(delays) - min(delays) > ceiling * 0.8  # spread over the whole range, not fixed


def test_no_host_asks_more_than_twice_a_second_even_near_the_deadline(emulator: MetadataEmulator) -> None:
    client = MetadataClient(emulator.url, timeout=0.5, rng=random.Random(5))  # the default backoff
    emulator.set_faults(status=503)
    with pytest.raises(MetadataError, match="HTTP 503"):
        client.get(TPU_ENV, deadline_s=3.0)
    times = emulator.request_times
    assert len(times) >= 3  # retried, including a shortened last wait
    assert all(later - earlier >= 0.5 for earlier, later in itertools.pairwise(times))
    client.close()


# --- the CLI helper --------------------------------------------------------------------------


def test_metadata_get_kinds(client: MetadataClient) -> None:
    assert metadata_get(client, "attributes", "startup-script") == "#!/bin/sh\n"
    assert metadata_get(client, "project-attributes", "ssh-keys") == "alice:ssh-ed25519 AAAA alice"
    assert metadata_get(client, "instance", "hostname") == "t1v-n-0.example.internal"
    with pytest.raises(MetadataAbsent):
        metadata_get(client, "attributes", "missing")


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        ("attrs", "x"),
        ("attributes", ""),
        ("attributes", "../x"),
        ("attributes", "a/b"),
        ("instance", "a/../b"),
    ],
)
def test_metadata_get_refuses_malformed_requests(client: MetadataClient, kind: str, key: str) -> None:
    with pytest.raises(UsageError):
        metadata_get(client, kind, key)


# --- long-polls and the change watch ----------------------------------------------------------


def test_wait_for_change_returns_the_new_value(client: MetadataClient, emulator: MetadataEmulator) -> None:
    etag = emulator.etag(TPU_ENV)
    changer = threading.Thread(
        target=lambda: emulator.wait_for_pollers(1) and emulator.set_attribute("tpu-env", "A: '2'\n")
    )
    changer.start()
    reply = client.wait_for_change(TPU_ENV, etag=etag, timeout_sec=30)
    changer.join()
    assert (reply.body, reply.etag) == (b"A: '2'\n", etag_of("A: '2'\n"))


def test_wait_for_change_times_out_with_the_same_etag(
    client: MetadataClient, emulator: MetadataEmulator
) -> None:
    etag = emulator.etag(TPU_ENV)
    assert client.wait_for_change(TPU_ENV, etag=etag, timeout_sec=1).etag == etag


class RecordingStop(threading.Event):
    """A stop event that records the watch's waits and skips them; sets itself after ``limit`` waits."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        if len(self.waits) >= self.limit:
            self.set()
        return self.is_set()


class Ceiling(random.Random):
    """Jitter that always picks the top of the range, so backoff growth is visible."""

    def uniform(self, a: float, b: float) -> float:
        return b


def drain(changes: Iterator[Change]) -> list[Change]:
    return list(changes)


@pytest.mark.parametrize("faults", [{"same_etag_at_once": True}, {"flapping_etag": True}, {"status": 503}])
def test_misbehaving_server_gets_backoff_not_a_tight_loop(
    emulator: MetadataEmulator, faults: dict[str, object]
) -> None:
    client = MetadataClient(emulator.url, timeout=2, backoff=Backoff(0.5, 8.0, floor=0.0), rng=Ceiling())
    etag = emulator.etag(TPU_ENV)
    emulator.set_faults(**faults)
    stop = RecordingStop(limit=6)
    drain(client.changes(TPU_ENV, stop=stop, etag=etag, timeout_sec=30))
    assert emulator.request_count == 6  # one request per wait: nothing between them
    # Each wait is the backoff ceiling (0.5, 1, 2, 4, 8, 8) but at least what is left of MIN_POLL_INTERVAL.
    assert 0.5 <= stop.waits[0] <= MIN_POLL_INTERVAL
    assert stop.waits[1:] == [1.0, 2.0, 4.0, 8.0, 8.0]
    client.close()


def test_changes_yields_current_value_first_then_each_change(emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    stop = threading.Event()
    seen: list[Change] = []
    got_two = threading.Event()

    def consume() -> None:
        for change in client.changes(TPU_ENV, stop=stop, timeout_sec=30):
            seen.append(change)
            if len(seen) == 2:
                got_two.set()

    worker = threading.Thread(target=consume)
    worker.start()
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", "A: '1'\n")
    assert got_two.wait(10)
    stop.set()
    client.close()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert seen[0] == Change(tpu_env_yaml(SAMPLE_TPU_ENV).encode(), emulator.etag(TPU_ENV) and seen[0].etag)
    assert seen[1] == Change(b"A: '1'\n", etag_of("A: '1'\n"))
    client.close()


def test_stop_and_close_interrupt_a_long_poll_in_flight(emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    stop = threading.Event()
    worker = threading.Thread(
        target=drain,
        args=(client.changes(TPU_ENV, stop=stop, etag=emulator.etag(TPU_ENV), timeout_sec=3600),),
    )
    worker.start()
    assert emulator.wait_for_pollers(1)
    stop.set()
    client.close()
    worker.join(timeout=5)
    assert not worker.is_alive()


def test_an_idle_watch_runs_no_thread_of_its_own(emulator: MetadataEmulator) -> None:
    """Nothing polls the stop event: the long-poll's blocking read is the only thing waiting."""
    client = make_client(emulator)
    stop = threading.Event()
    before = set(threading.enumerate())
    changes = client.changes(TPU_ENV, stop=stop, etag=emulator.etag(TPU_ENV), timeout_sec=3600)
    worker = threading.Thread(target=drain, args=(changes,))
    worker.start()
    assert emulator.wait_for_pollers(1)
    new = {t for t in threading.enumerate() if t not in before and "process_request" not in t.name}
    assert new == {worker}  # the emulator's own request thread aside
    stop.set()
    client.close()
    worker.join(timeout=5)


def test_vanished_key_is_reported_once_then_polled_until_back(emulator: MetadataEmulator) -> None:
    client = make_client(emulator)
    stop = threading.Event()
    seen: list[Change] = []
    back = threading.Event()

    def consume() -> None:
        for change in client.changes(TPU_ENV, stop=stop, etag=emulator.etag(TPU_ENV), timeout_sec=30):
            seen.append(change)
            if change.value is not None:
                back.set()

    worker = threading.Thread(target=consume)
    worker.start()
    assert emulator.wait_for_pollers(1)
    emulator.set_attribute("tpu-env", None)
    assert emulator.wait_for_requests(emulator.request_count + 4)  # several 404 answers, reported once
    emulator.set_attribute("tpu-env", "B: '2'\n")
    assert back.wait(20)
    stop.set()
    client.close()
    worker.join(timeout=10)
    assert seen == [Change(None, None), Change(b"B: '2'\n", etag_of("B: '2'\n"))]
    client.close()


# --- google-auth, the reference client, agrees with the emulator ---------------------------

GOOGLE_AUTH_PROBE = """
import ipaddress, json, socket, sys
def loopback_only(event, args):  # an audit hook: google-auth cannot reach past it (PEP 578)
    if event == "socket.connect" and args[0].family in (socket.AF_INET, socket.AF_INET6):
        if not ipaddress.ip_address(args[1][0]).is_loopback:
            raise OSError(f"probe may only reach 127.0.0.1, not {args[1]}")
sys.addaudithook(loopback_only)
import google.auth.transport.requests as transport
from google.auth.compute_engine import _metadata
request = transport.Request()
print(json.dumps({
    "ping": _metadata.ping(request),
    "tpu_env": _metadata.get(request, "instance/attributes/tpu-env"),
    "hostname": _metadata.get(request, "instance/hostname"),
    "ssh_keys": _metadata.get(request, "project/attributes/ssh-keys"),
    "listing": _metadata.get(request, "instance/attributes/"),
    "recursive": _metadata.get(request, "instance/attributes/", recursive=True),
    "missing": _metadata.get(request, "instance/attributes/nope", return_none_for_not_found_error=True),
}))
"""


def test_google_auth_reads_the_emulator_like_our_client(
    client: MetadataClient, emulator: MetadataEmulator
) -> None:
    pytest.importorskip("google.auth", reason="pip install google-auth (scripts/test-requirements.txt)")
    env = {
        "GCE_METADATA_HOST": emulator.host,
        "GCE_METADATA_IP": emulator.host,
        "NO_PROXY": "*",
        "PATH": "/usr/bin:/bin",
    }
    run = subprocess.run(
        [sys.executable, "-c", GOOGLE_AUTH_PROBE], env=env, capture_output=True, check=True, timeout=60
    )
    seen = json.loads(run.stdout)
    assert seen["ping"] is True
    assert seen["tpu_env"] == client.get(TPU_ENV, deadline_s=5).text
    assert seen["hostname"] == metadata_get(client, "instance", "hostname")
    assert seen["ssh_keys"] == metadata_get(client, "project-attributes", "ssh-keys")
    assert seen["listing"] == "startup-script\ntpu-env\n"
    assert seen["recursive"] == {"startup-script": "#!/bin/sh\n", "tpu-env": tpu_env_yaml(SAMPLE_TPU_ENV)}
    assert seen["missing"] is None
    with pytest.raises(MetadataAbsent):
        client.get("instance/attributes/nope", deadline_s=5)


def test_emulator_runs_standalone_for_vm_guests(tmp_path: Path) -> None:
    attributes = tmp_path / "attributes.yaml"
    attributes.write_text("tpu-env:\n  ACCELERATOR_TYPE: v5p-8\n  WORKER_ID: '0'\nplain: text\n")
    emulator = subprocess.Popen(
        [sys.executable, str(Path(mds_emulator.__file__)), "--port", "0", "--attributes", str(attributes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert emulator.stdout is not None
        host = emulator.stdout.readline().split()[-1]
        client = MetadataClient(f"http://{host}/computeMetadata/v1/", timeout=5)
        assert parse_tpu_env(client.get(TPU_ENV, deadline_s=10).body).values == {
            "ACCELERATOR_TYPE": "v5p-8",
            "WORKER_ID": "0",
        }
        assert metadata_get(client, "attributes", "plain") == "text"
        client.close()
    finally:
        emulator.terminate()
        out, _ = emulator.communicate(timeout=10)
    assert json.loads(out)["requests"] == 2


def test_a_flapping_server_costs_one_line_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    from tpuboot.gce.failures import FailureLog

    failures = FailureLog()
    with caplog.at_level(logging.INFO, logger="tpuboot.gce"):
        for kind in ("connection dropped", "timed out", "connection dropped", "timed out"):
            failures.failed(kind, "http://127.0.0.1:1/", retrying=True)
        failures.recovered("http://127.0.0.1:1/")
        failures.failed("timed out", "http://127.0.0.1:1/", retrying=True)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING, logging.INFO, logging.WARNING]
    assert "answering again (was: connection dropped, timed out)" in lines[2][1]


# --- guest attributes: the client's PUT, and the emulator as the real server answers -----------

GUEST = "instance/guest-attributes/tpuboot/state"


def enable_guest_attributes(emulator: MetadataEmulator, value: str = "TRUE") -> None:
    emulator.set_attribute("enable-guest-attributes", value)


def test_put_stores_and_get_reads_back(client: MetadataClient, emulator: MetadataEmulator) -> None:
    enable_guest_attributes(emulator)
    client.put(GUEST, "ready ☃", deadline_s=5)
    assert client.get(GUEST, deadline_s=5).text == "ready ☃"
    assert client.get("instance/guest-attributes/tpuboot/", deadline_s=5).text == "state\n"
    assert emulator.guest_attributes("tpuboot") == {"tpuboot/state": "ready ☃"}
    with pytest.raises(MetadataAbsent):
        client.get("instance/guest-attributes/tpuboot/other", deadline_s=5)


def test_delete_removes_a_guest_attribute(emulator: MetadataEmulator) -> None:
    enable_guest_attributes(emulator)
    headers = {"Metadata-Flavor": "Google"}
    assert requests.put(emulator.url + GUEST, data=b"x", headers=headers, timeout=5).status_code == 200
    assert requests.delete(emulator.url + GUEST, headers=headers, timeout=5).status_code == 200
    assert emulator.guest_attributes() == {}


@pytest.mark.parametrize(
    ("instance", "project", "enabled"),
    [
        (None, None, False),  # GCE's default
        ("TRUE", None, True),
        (None, "true", True),
        ("1", None, True),
        ("FALSE", "TRUE", False),  # the instance's value wins
        ("yes", None, False),  # not a value Go's ParseBool accepts
    ],
)
def test_emulator_decides_like_the_server(
    emulator: MetadataEmulator, instance: str | None, project: str | None, enabled: bool
) -> None:
    emulator.set_attribute("enable-guest-attributes", instance)
    emulator.set("project/attributes/enable-guest-attributes", project)
    assert emulator.guest_attributes_enabled() is enabled


def test_disabled_guest_attributes_are_refused_with_403_and_the_servers_reason(
    client: MetadataClient, emulator: MetadataEmulator
) -> None:
    with pytest.raises(
        MetadataRefused, match=r"HTTP 403 \(Guest attributes endpoint access is disabled.\)"
    ) as info:
        client.put(GUEST, "ready", deadline_s=5)
    assert info.value.status == 403
    with pytest.raises(MetadataRefused, match="HTTP 403"):
        client.get("instance/guest-attributes/", deadline_s=5)
    assert emulator.request_count == 2  # a refusal is not retried
    assert emulator.guest_attribute_writes == 1
    assert emulator.guest_attributes() == {}


def test_guest_attribute_names_are_namespace_and_key(
    client: MetadataClient, emulator: MetadataEmulator
) -> None:
    enable_guest_attributes(emulator)
    with pytest.raises(MetadataRefused, match="HTTP 400") as info:
        client.put("instance/guest-attributes/no-namespace", "x", deadline_s=5)
    assert info.value.status == 400


def test_put_requires_the_flavor_header_like_a_get(emulator: MetadataEmulator) -> None:
    enable_guest_attributes(emulator)
    assert requests.put(emulator.url + GUEST, data=b"x", timeout=5).status_code == 403
    assert emulator.guest_attributes() == {}


def test_put_is_retried_within_its_deadline(client: MetadataClient, emulator: MetadataEmulator) -> None:
    enable_guest_attributes(emulator)
    emulator.fail_next(2, status=503)
    client.put(GUEST, "ready", deadline_s=10)
    assert emulator.request_count == 3
    assert emulator.guest_attributes() == {"tpuboot/state": "ready"}


def test_put_with_max_tries_asks_once(client: MetadataClient, emulator: MetadataEmulator) -> None:
    enable_guest_attributes(emulator)
    emulator.set_faults(status=503)
    with pytest.raises(MetadataError, match=r"HTTP 503 \(1 try in 10 s\)"):
        client.put(GUEST, "ready", deadline_s=10, max_tries=1)
    assert emulator.request_count == 1


@pytest.mark.parametrize(
    "faults",
    [{"flavor": None}, {"flavor": "Evil"}, {"content_length": "5"}, {"delay": 3.0}, {"trickle_headers": 0.3}],
    ids=["no-flavor", "wrong-flavor", "short-body", "slow", "trickle"],
)
def test_a_hostile_server_cannot_hold_a_put_past_its_deadline(
    emulator: MetadataEmulator, faults: dict[str, object]
) -> None:
    enable_guest_attributes(emulator)
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(**faults)
    started = time.monotonic()
    with pytest.raises(MetadataUnanswered, match=r"tries? in 2 s\)"):  # given up at the deadline
        client.put(GUEST, "ready", deadline_s=2.0)
    # Only a hang passes this bound (10x the deadline), not a loaded machine.
    assert time.monotonic() - started < 10 * 2.0
    client.close()


# --- the tests' own guard (tests/unit/conftest.py) ----------------------------------------------

ONLY_LOOPBACK = r"tests may only reach 127\.0\.0\.1"


def test_no_test_reaches_past_loopback_even_after_undoing_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard is an audit hook, not a patch: undoing a test's patches, or calling connect through
    another name, does not lift it. 192.0.2.1 is TEST-NET-1: never routed, were the guard to fail."""
    monkeypatch.undo()
    with socket.socket() as sock, pytest.raises(AssertionError, match=ONLY_LOOPBACK):
        sock.settimeout(0.2)
        sock.connect(("192.0.2.1", 9))
    with socket.socket() as sock, pytest.raises(AssertionError, match=ONLY_LOOPBACK):
        sock.settimeout(0.2)
        sock.connect_ex(("192.0.2.1", 9))
    with pytest.raises(AssertionError, match=ONLY_LOOPBACK):
        MetadataClient(timeout=0.2).get("instance/hostname", deadline_s=0.2)  # the default address


# --- failures told by URL and by what they are ------------------------------------------------------


def test_an_answer_on_one_url_is_no_recovery_for_another(
    client: MetadataClient, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """One client serves tpu-env, the guest attributes and the GKE check: a guest-attribute write
    that works while tpu-env fails must not say tpu-env's server is "answering again"."""
    enable_guest_attributes(emulator)
    with caplog.at_level(logging.INFO, logger="tpuboot.gce"):
        for _ in range(2):  # tpu-env fails, the others answer in between, tpu-env fails again
            emulator.set_faults(status=503)
            with pytest.raises(MetadataError, match="HTTP 503"):
                client.get(TPU_ENV, deadline_s=0.3)
            emulator.set_faults()
            client.put(GUEST, "ready", deadline_s=5)
            client.get("instance/hostname", deadline_s=5)
        said = [r.getMessage() for r in caplog.records]
        client.get(TPU_ENV, deadline_s=5)
        recovered = [r.getMessage() for r in caplog.records][len(said) :]
    assert not any("answering again" in line for line in said), said
    assert sum("HTTP 503; retrying" in line for line in said) == 1, said  # once, not once per recovery
    again = [line for line in recovered if "answering again" in line]
    assert len(again) == 1 and "tpu-env: answering again (was: HTTP 503" in again[0]


def test_failure_kinds_are_kept_per_url() -> None:
    from tpuboot.gce.failures import FailureLog

    failures = FailureLog()
    a, b = "http://127.0.0.1:1/a", "http://127.0.0.1:1/b"
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tpuboot.gce")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        failures.failed("timed out", a, retrying=True)
        failures.failed("timed out", b, retrying=True)  # b's own first failure: said
        failures.recovered(b)
        failures.failed("timed out", a, retrying=True)  # a still failing: not said again
        failures.recovered(a)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert [line.split(":", 3)[2].split(" ")[0][-1] for line in records] == ["a", "b", "b", "a"]
    assert "answering again (was: timed out)" in records[2] and records[2].startswith(f"metadata server {b}")


@pytest.mark.parametrize(
    ("faults", "kind"),
    [
        ({"extra_headers": 5000}, "answer with more than 100 header lines"),
        ({"extra_headers": 101}, "answer with more than 100 header lines"),
        ({"long_header": 70000}, "answer with a header line over 64 KiB"),
        ({"status_line": b"HTTQ/1.1 200 OK"}, "answer with no valid HTTP status line"),
        ({"status_line": b"HTTP/1.1 2OO OK\x1b[2J"}, "answer with no valid HTTP status line"),
    ],
    ids=["5000 headers", "101 headers", "a 70 kB header", "no HTTP", "a status that is no number"],
)
def test_a_malformed_head_is_reported_as_what_it_is(
    emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture, faults: dict[str, object], kind: str
) -> None:
    """Before: each was "connection dropped" (urllib3 says "Connection aborted" around the parser's
    complaint), which sends an operator to the network instead of to whatever answers."""
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(**faults)
    with (
        caplog.at_level(logging.WARNING, logger="tpuboot.gce"),
        pytest.raises(MetadataError) as raised,
    ):
        client.get(TPU_ENV, deadline_s=0.5)
    client.close()
    assert kind in str(raised.value) and "dropped" not in str(raised.value)
    warnings = [r.getMessage() for r in caplog.records]
    assert kind in warnings[0]  # once: a loaded machine may add a timeout, never a drop
    assert not any("dropped" in line or "\x1b" in line for line in warnings)  # nor what the server sent


def test_a_watch_reports_a_malformed_head_as_what_it_is(
    emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(extra_headers=5000)
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="tpuboot.gce"):
        worker = threading.Thread(target=drain, args=(client.changes(TPU_ENV, stop=stop),))
        worker.start()
        assert emulator.wait_for_requests(emulator.request_count + 3)
        stop.set()
        client.close()
        worker.join(timeout=10)
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("answer with more than 100 header lines" in line for line in warnings) == 1, warnings
    assert not any("dropped" in line for line in warnings)


def test_a_new_etag_over_the_same_value_is_no_change(emulator: MetadataEmulator) -> None:
    """A flapping server's long-polls return at once, each with a new ETag: the watch yields the
    value it did not know yet, then nothing until the value itself changes."""
    client = make_client(emulator)
    emulator.set_faults(flapping_etag=True)
    stop = threading.Event()
    seen: list[Change] = []

    def consume() -> None:
        for change in client.changes(TPU_ENV, stop=stop, timeout_sec=30):
            seen.append(change)

    worker = threading.Thread(target=consume)
    worker.start()
    try:
        assert emulator.wait_for_requests(12)  # twelve answers, each with an ETag of its own
        assert [c.value for c in seen] == [tpu_env_yaml(SAMPLE_TPU_ENV).encode()]
        emulator.set_attribute("tpu-env", "A: '1'\n")
        assert emulator.wait_for_requests(emulator.request_count + 6)
    finally:
        stop.set()
        client.close()
        worker.join(timeout=10)
    assert [c.value for c in seen] == [tpu_env_yaml(SAMPLE_TPU_ENV).encode(), b"A: '1'\n"]
