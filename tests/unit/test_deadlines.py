"""Deadlines that hold: a server that is up but trickles its answer cannot hold tpuboot past them.

A socket timeout bounds one receive; these servers send a byte every 0.3 s, well inside it,
forever. What proves each deadline is the outcome (cut, 'timed out', given up); the wall-clock
bound is HANG times the deadline, which only a call the deadline did not end passes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.helpers.deadlines import HANG, TRICKLE, timed
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot import cli
from tpuboot.env.sync import EnvSync
from tpuboot.errors import MetadataError
from tpuboot.gce.client import MetadataClient
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root

TPU_ENV = "instance/attributes/tpu-env"


@pytest.mark.parametrize("part", ["trickle_headers", "trickle_body"])
def test_get_ends_by_its_deadline_whatever_the_server_trickles(emulator: MetadataEmulator, part: str) -> None:
    client = make_client(emulator, timeout=1.0)  # per receive: each trickled byte comes well inside it
    emulator.set_faults(**{part: TRICKLE})
    deadline = 1.0  # the server trickles forever: any deadline shows it ends
    outcome = timed(lambda: client.get(TPU_ENV, deadline_s=deadline), HANG * deadline)
    assert isinstance(outcome, MetadataError), outcome
    assert "timed out" in str(outcome)
    client.close()


def test_one_try_ends_by_the_client_timeout_so_a_retry_can_reach_a_good_answer(
    emulator: MetadataEmulator,
) -> None:
    """The first answer trickles; the retry, answered well, arrives before the deadline."""
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(trickle_body=TRICKLE)
    threading.Timer(0.5, emulator.set_faults).start()  # the server is well again before the try ends
    # A try the timeout did not end would trickle its body for minutes: the get would end in the
    # deadline's error (or run past the bound), not with the retry's answer.
    outcome = timed(lambda: client.get(TPU_ENV, deadline_s=10), HANG * 1.0)
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.etag == emulator.etag(TPU_ENV)
    client.close()


@pytest.mark.parametrize("part", ["trickle_headers", "trickle_body"])
def test_a_long_poll_ends_by_its_hang_time_plus_the_timeout(emulator: MetadataEmulator, part: str) -> None:
    client = make_client(emulator, timeout=1.0)
    etag = emulator.etag(TPU_ENV)
    emulator.set_faults(**{part: TRICKLE})
    outcome = timed(lambda: client.wait_for_change(TPU_ENV, etag=etag, timeout_sec=1), HANG * 2.0)
    assert isinstance(outcome, MetadataError), outcome
    assert "timed out" in str(outcome)
    client.close()


def test_a_watch_on_a_trickling_server_keeps_its_pace_and_stops(emulator: MetadataEmulator) -> None:
    """Each poll ends on time: the watch retries with backoff instead of hanging in one poll."""
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(trickle_headers=TRICKLE)
    stop = threading.Event()
    worker = threading.Thread(
        target=lambda: list(client.changes(TPU_ENV, stop=stop, etag=emulator.etag(TPU_ENV), timeout_sec=1)),
        daemon=True,
    )
    worker.start()
    assert emulator.wait_for_requests(3, timeout=3 * HANG * 2.0)  # one poll ends by 2 s, then again
    stop.set()
    client.close()
    worker.join(5)
    assert not worker.is_alive()


@pytest.mark.parametrize("part", ["trickle_headers", "trickle_body"])
def test_sync_ends_by_the_boot_deadline(root: Root, emulator: MetadataEmulator, part: str) -> None:
    client = make_client(emulator, timeout=1.0)
    sync = EnvSync(root, make_config(emulator), client)
    emulator.set_faults(**{part: TRICKLE})
    deadline = 1.0
    result = timed(lambda: sync.sync_once(deadline_s=deadline), HANG * deadline)
    assert result.source != "metadata", result
    client.close()


def test_tpuboot_env_ends_by_its_deadline(
    emulator: MetadataEmulator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The command with its default configuration (a 5 s per-receive timeout) and ``--deadline 1``."""
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    top = tmp_path / "root"
    (top / "etc").mkdir(parents=True)
    emulator.set_faults(trickle_headers=TRICKLE)
    code = timed(lambda: cli.main(["--root", str(top), "env", "--deadline", "1"]), HANG * 1.0)
    assert code == cli.EXIT_FAILED


# --- numbers from the network ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("1234", 1234),
        ("²", None),
        ("١٢", None),  # Arabic-Indic digits: str.isdigit and int accept them
        ("+12", None),
        (" 12", None),
        ("1_2", None),
        ("", None),
        ("9" * 21, None),
        (b"12", 12),
        (b"\xb2", None),
        (None, None),
    ],
)
def test_ascii_int_takes_ascii_digits_only(text: str | bytes | None, value: int | None) -> None:
    assert ascii_int(text) == value


@pytest.mark.parametrize("length", ["²", "1_0", "+5", "5, 5"])
def test_a_content_length_that_is_not_ascii_digits_is_refused(
    emulator: MetadataEmulator, length: str
) -> None:
    client = make_client(emulator, timeout=1.0)
    emulator.set_faults(content_length=length)
    with pytest.raises(MetadataError, match=r"Content-Length .* not a number"):
        client.get(TPU_ENV, deadline_s=1.0)
    client.close()


def test_a_huge_content_length_is_refused_before_reading(emulator: MetadataEmulator) -> None:
    client: MetadataClient = make_client(emulator, timeout=1.0)
    emulator.set_faults(content_length="9" * 19)
    with pytest.raises(MetadataError, match="over 1048576 bytes"):
        client.get(TPU_ENV, deadline_s=5.0)
    assert emulator.request_count == 1
    client.close()
