"""The Engine API client against a dockerd that misbehaves: each a one-line error in bounded time and memory.

A trickled answer, a body shorter than its Content-Length, a Content-Length that is not ASCII
digits or is huge, a broken chunked encoding, an event that is not JSON, a stream without a
newline. Then the supervisor over such a dockerd: it says why, and comes back with backoff.
"""

from __future__ import annotations

import json
import re
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import engine_of
from tests.unit.helpers.deadlines import HANG, TRICKLE, timed
from tpuboot.backoff import RestartPolicy
from tpuboot.containers.dockerapi import MAX_BODY, DockerAPI
from tpuboot.containers.dockerwire import MAX_LINE, DockerError, ProtocolError, Unreachable
from tpuboot.containers.engine import ContainerSpec
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.runtime import runtime_on
from tpuboot.containers.supervisor import Supervisor
from tpuboot.paths import Root
from tpuboot.references import RegistryAllowlist


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


def negotiated(fake: FakeDockerd, timeout: float = 5.0, max_body: int = MAX_BODY) -> DockerAPI:
    client = DockerAPI(str(fake.socket_path), timeout=timeout, max_body=max_body)
    client.ping()
    return client


# --- deadlines ---------------------------------------------------------------------------------


def test_a_trickled_answer_cannot_hold_a_call_past_its_timeout(dockerd: FakeDockerd) -> None:
    client = negotiated(dockerd, timeout=1.0)  # each byte comes well inside the per-read timeout
    dockerd.trickle = TRICKLE
    outcome = timed(lambda: client.inspect_container("vbar"), HANG * 1.0)
    assert isinstance(outcome, Unreachable), outcome
    assert "timed out" in str(outcome)


def test_the_event_streams_headers_come_within_the_timeout(dockerd: FakeDockerd) -> None:
    """The stream has no timeout once open; opening it has one."""
    client = negotiated(dockerd, timeout=1.0)
    dockerd.trickle = TRICKLE
    outcome = timed(lambda: client.events({"event": ["die"]}), HANG * 1.0)
    assert isinstance(outcome, Unreachable), outcome
    assert "timed out" in str(outcome)


def test_an_open_event_stream_waits_past_the_timeout(dockerd: FakeDockerd) -> None:
    client = negotiated(dockerd, timeout=0.5)
    dockerd.add_container("vbar", "img:1")
    stream = client.events({"event": ["die"]})
    threading.Timer(1.5, dockerd.die, ("vbar", 3)).start()
    events = []
    for event in stream:
        events.append(event)
        break
    stream.close()
    assert events[0]["Action"] == "die"


# --- answers that break the protocol ---------------------------------------------------------


def answer(head: str, body: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head.encode("latin-1") + b"\r\n" + body


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (answer("Content-Length: 100\r\n", b'{"Id": "x"'), "ended after 10 of 100 bytes"),
        (answer("Content-Length: \xb2\r\n", b"{}"), "Content-Length '²' .* not a number"),
        (answer("Content-Length: \u00d9\u00a1\r\n", b"{}"), "not a number"),  # U+0661 in UTF-8, as sent
        (answer("Content-Length: 1_0\r\n", b'{"Id": "x1234567"}'), "not a number"),
        (answer("Content-Length: +2\r\n", b"{}"), "not a number"),
        (answer("Content-Length: 2\r\nContent-Length: 3\r\n", b"{}"), "two Content-Lengths"),
        (answer("Content-Length: 99999999999999999999\r\n", b"{}"), "announced 99999999999999999999 bytes"),
        (answer("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n"), "malformed chunked"),
        (answer("Content-Length: 9\r\n", b"not json!"), "not JSON"),
    ],
)
def test_a_malformed_answer_is_a_one_line_protocol_error(
    dockerd: FakeDockerd, raw: bytes, message: str
) -> None:
    client = negotiated(dockerd)
    dockerd.raw_answer = raw
    with pytest.raises(ProtocolError, match=message) as caught:
        client.inspect_container("vbar")
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, Unreachable)  # callers reconnect later, as for dockerd gone


def test_an_endless_body_is_cut_at_the_cap(dockerd: FakeDockerd) -> None:
    client = negotiated(dockerd, max_body=100_000)
    dockerd.raw_answer = answer("Connection: close\r\n", b"[" + b"1," * 200_000)
    with pytest.raises(ProtocolError, match="over 100000 bytes"):
        client.inspect_container("vbar")


def test_the_negotiated_version_is_ascii_digits(dockerd: FakeDockerd) -> None:
    client = DockerAPI(str(dockerd.socket_path), timeout=5)
    body = json.dumps({"ApiVersion": "\u0661.\u0664\u0661"}).encode()  # Arabic-Indic 1.41: \d, int() take it
    dockerd.raw_answer = answer(f"Content-Length: {len(body)}\r\n", body)
    with pytest.raises(DockerError, match="no usable ApiVersion"):
        client.ping()


# --- streams ------------------------------------------------------------------------------------


def drain(fake: FakeDockerd) -> list[dict[str, Any]]:
    return list(negotiated(fake).events({"event": ["die"]}))


@pytest.mark.parametrize(
    ("preamble", "message"),
    [
        (b"9\r\nnot json\n\r\n", "an event with a line that is not JSON: b'not json'"),
        (b"zz\r\n", "malformed chunked encoding"),
    ],
)
def test_an_event_stream_that_breaks_the_protocol_raises_one_line(
    dockerd: FakeDockerd, preamble: bytes, message: str
) -> None:
    dockerd.event_preamble = preamble
    outcome = timed(lambda: drain(dockerd), 30.0)  # the stream stays open: a reader that went on would hang
    assert isinstance(outcome, ProtocolError), outcome
    assert "\n" not in str(outcome)
    assert re.search(message, str(outcome)), outcome


def test_a_stream_without_newlines_is_refused_in_bounded_memory(dockerd: FakeDockerd) -> None:
    dockerd.event_flood = 64 * MAX_LINE  # the client must stop long before
    tracemalloc.start()
    try:
        outcome = timed(lambda: drain(dockerd), 20.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(outcome, ProtocolError), outcome
    assert f"a line over {MAX_LINE} bytes and no newline" in str(outcome)
    assert peak < 8 * MAX_LINE


def test_a_pull_whose_progress_is_not_json_is_a_protocol_error(dockerd: FakeDockerd) -> None:
    client = negotiated(dockerd)
    dockerd.raw_answer = answer("Transfer-Encoding: chunked\r\n", b"6\r\n<html>\r\n0\r\n\r\n")
    with pytest.raises(ProtocolError, match="pull progress with a line that is not JSON"):
        client.pull_image("img", "1")


# --- the supervisor goes on -------------------------------------------------------------------


def test_a_garbled_event_stream_makes_the_supervisor_wait_and_come_back_with_backoff(
    dockerd: FakeDockerd,
) -> None:
    dockerd.images.add("img:1")
    dockerd.event_preamble = b"9\r\nnot json\n\r\n"
    runtime = runtime_on(
        HOST_ENGINE,
        Root(dockerd.root),
        lambda: ContainerSpec("vbar", "img:1"),
        client=engine_of(dockerd, timeout=5),
        allowlist=RegistryAllowlist(["docker.io"], "vbar.registries"),
    )
    statuses: list[str] = []
    policy = RestartPolicy(1.0, 8.0, 600.0)
    supervisor = Supervisor("vbar", runtime, policy, lambda label, s: statuses.append(f"{label}: {s.detail}"))
    started = time.monotonic()
    supervisor.start()
    try:
        deadline = started + 30  # generous: only a hung supervisor takes this long, load does not
        while sum("not JSON" in status and "waiting" in status for status in statuses) < 2:
            assert time.monotonic() < deadline, statuses
            time.sleep(0.01)
        # Backoff, timed from before start(), so load can only lengthen it: the second stream came
        # 1 s after the first, and the supervisor now waits 2 s; without it, hundreds of streams.
        assert time.monotonic() - started >= 1.0
        assert len(dockerd.subscribers) == 2, len(dockerd.subscribers)
        assert not supervisor.delays  # not counted as the container's exits
        assert len(dockerd.calls("POST", "/containers/create")) == 1  # adopted after, never recreated
        dockerd.event_preamble = None  # dockerd well again: the supervisor follows the container
        while not statuses or statuses[-1] != "vbar: running" or len(dockerd.subscribers) == 2:
            assert time.monotonic() < deadline, statuses
            time.sleep(0.05)
        assert time.monotonic() - started >= 3.0  # the third stream: 1 s, then 2 s
        dockerd.die("vbar", 7)
        while not any("exit 7" in status for status in statuses):
            assert time.monotonic() < deadline, statuses
            time.sleep(0.05)
    finally:
        supervisor.stop()
