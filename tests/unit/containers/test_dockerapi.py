"""The Engine API client against a fake dockerd on a real unix socket (tests/unit/fakes/dockerd.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.polling import wait_until
from tests.unit.fakes.dockerd import ENGINES, FakeDockerd, fake_dockerd
from tpuboot.containers.dockerapi import NEWEST_API, DockerAPI, auth_header, negotiate
from tpuboot.containers.dockerwire import APIError, DockerError, NotFound, UnixConnection, Unreachable
from tpuboot.containers.engine import RegistryAuth


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


def client_of(fake: FakeDockerd) -> DockerAPI:
    return DockerAPI(str(fake.socket_path), timeout=5)


@pytest.mark.parametrize(("engine", "minimum"), [("1.41", "1.12"), ("1.52", "1.44")])
def test_the_api_version_is_the_one_dockerd_speaks(engine: str, minimum: str) -> None:
    """Debian 12's dockerd (1.41) and a current one that refuses anything older than 1.44."""
    with fake_dockerd(engine, minimum) as fake:
        client = client_of(fake)
        assert client.ping() == engine
        with pytest.raises(NotFound):
            client.inspect_container("vbar")
        fake.images.add("img:1")
        client.inspect_image("img:1")
    assert fake.paths() == ["/version", f"/v{engine}/containers/vbar/json", f"/v{engine}/images/img:1/json"]


def test_the_version_is_asked_once_before_the_first_call() -> None:
    with fake_dockerd("1.47") as fake:
        client = client_of(fake)
        fake.images.add("img:1")
        client.inspect_image("img:1")
        client.inspect_image("img:1")
    assert fake.paths() == ["/version", "/v1.47/images/img:1/json", "/v1.47/images/img:1/json"]


def raw_get(fake: FakeDockerd, path: str) -> tuple[int, dict[str, Any]]:
    """One GET as any client would send it, no negotiation: the fake's own answer."""
    conn = UnixConnection(str(fake.socket_path), 5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("engine", "path", "message"),
    [
        (
            "docker29",
            "/v1.40/version",
            "client version 1.40 is too old. Minimum supported API version is 1.44, "
            "please upgrade your client to a newer version",
        ),
        (
            "debian12",
            "/v1.11/containers/vbar/json",
            "client version 1.11 is too old. Minimum supported API version is 1.12, "
            "please upgrade your client to a newer version",
        ),
        (
            "debian12",
            "/v1.44/version",
            "client version 1.44 is too new. Maximum supported API version is 1.41",
        ),
    ],
)
def test_the_fake_refuses_a_version_out_of_range_as_dockerd_does(
    engine: str, path: str, message: str
) -> None:
    """dockerd's version middleware (moby's wording): HTTP 400 before any route."""
    with fake_dockerd(*ENGINES[engine]) as fake:
        assert raw_get(fake, path) == (400, {"message": message})
        status, version = raw_get(fake, "/version")  # unversioned: always answered
    api, minimum, engine_version = ENGINES[engine]
    assert status == 200
    assert (version["ApiVersion"], version["MinAPIVersion"], version["Version"]) == (
        api,
        minimum,
        engine_version,
    )


@pytest.mark.parametrize(
    ("engine", "spoken"),
    [("debian12", "1.41"), ("docker29", "1.52"), ("future", NEWEST_API)],
)
def test_negotiation_against_each_engine(engine: str, spoken: str) -> None:
    """Debian 12's 20.10, Docker 29 (minimum 1.44), and an engine newer than tpuboot knows: spoken
    at tpuboot's newest, which that engine still accepts."""
    with fake_dockerd(*ENGINES[engine]) as fake:
        client = client_of(fake)
        assert client.ping() == spoken
        assert client.daemon_versions == ENGINES[engine][1::-1]
        fake.images.add("img:1")
        client.create_container("vbar", {"Image": "img:1"})
        client.start_container("vbar")
        assert client.inspect_container("vbar")["State"]["Running"] is True
    assert fake.paths() == [
        "/version",
        f"/v{spoken}/containers/create",
        f"/v{spoken}/containers/vbar/start",
        f"/v{spoken}/containers/vbar/json",
    ]


@pytest.mark.parametrize(
    ("newest", "oldest", "message"),
    [
        (
            "1.70",
            "1.60",
            "dockerd accepts Engine API 1.60 to 1.70 and tpuboot speaks 1.24 to 1.52: upgrade tpuboot",
        ),
        ("1.23", "1.12", "dockerd speaks Engine API 1.23 at most and tpuboot needs 1.24: upgrade Docker"),
    ],
)
def test_an_engine_with_no_version_in_common_is_a_one_line_error(
    newest: str, oldest: str, message: str
) -> None:
    with fake_dockerd(newest, oldest) as fake:
        client = client_of(fake)
        with pytest.raises(DockerError) as caught:
            client.inspect_container("vbar")
    assert str(caught.value) == message
    assert fake.paths() == ["/version"]  # nothing sent in a version dockerd would refuse


@pytest.mark.parametrize(
    ("newest", "oldest", "spoken"),
    [
        ("1.41", "1.12", "1.41"),
        ("1.52", "1.44", "1.52"),
        ("1.100", "1.44", "1.52"),  # compared as numbers, not text
        ("1.9", None, None),
        ("1.41", None, "1.41"),
        ("2.0", "1.44", "1.52"),
    ],
)
def test_negotiate(newest: str, oldest: str | None, spoken: str | None) -> None:
    if spoken is None:
        with pytest.raises(DockerError):
            negotiate(newest, oldest)
    else:
        assert negotiate(newest, oldest) == spoken


def test_an_engine_that_gives_no_minimum_is_spoken_to_at_its_newest() -> None:
    with fake_dockerd("1.41", None) as fake:
        client = client_of(fake)
        assert client.ping() == "1.41" and client.daemon_versions == (None, "1.41")


@pytest.mark.parametrize(("before", "after"), [("debian12", "docker29"), ("docker29", "debian12")])
def test_dockerd_upgraded_or_downgraded_under_a_running_client_is_renegotiated_once(
    before: str, after: str
) -> None:
    """apt upgrades docker.io from 20.10 to 29 (now 1.41 is too old), or back (1.52 too new)."""
    with fake_dockerd(*ENGINES[before]) as fake:
        client = client_of(fake)
        with pytest.raises(NotFound):
            client.inspect_container("vbar")
        fake.api_version, fake.min_api_version, fake.engine_version = ENGINES[after]
        with pytest.raises(NotFound):
            client.inspect_container("vbar")
        stream = client.events({"event": ["die"]})
        stream.close()
    old, new = ENGINES[before][0], ENGINES[after][0]
    assert fake.paths() == [
        "/version",
        f"/v{old}/containers/vbar/json",
        f"/v{old}/containers/vbar/json",  # refused: HTTP 400
        "/version",
        f"/v{new}/containers/vbar/json",
        f"/v{new}/events",
    ]
    assert client.api_version == new


def test_another_http_400_is_not_resent() -> None:
    with fake_dockerd(*ENGINES["docker29"]) as fake:
        client = client_of(fake)
        with pytest.raises(APIError) as caught:
            client.create_container("vbar", {"Labels": {}})
    assert (caught.value.status, caught.value.explanation) == (400, "config is missing the Image")
    assert fake.paths() == ["/version", "/v1.52/containers/create"]


def test_errors_carry_dockerds_status_and_message(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    with pytest.raises(NotFound) as absent:
        client.inspect_image("nope:1")
    assert (absent.value.status, absent.value.explanation) == (404, "No such image: nope:1")
    dockerd.images.add("img:1")
    client.create_container("vbar", {"Image": "img:1"})
    with pytest.raises(APIError) as conflict:
        client.create_container("vbar", {"Image": "img:1"})
    assert conflict.value.status == 409 and not isinstance(conflict.value, NotFound)
    assert 'The container name "/vbar" is already in use' in str(conflict.value)


def test_dockerd_absent_or_refusing_is_unreachable(tmp_path: Path) -> None:
    directory = tmp_path / "d"
    directory.mkdir()
    with pytest.raises(Unreachable):
        DockerAPI(str(directory / "docker.sock")).ping()
    stale = socket.socket(socket.AF_UNIX)  # a socket file nobody listens on: refused
    stale.bind(str(directory / "s"))
    stale.close()
    with pytest.raises(Unreachable):
        DockerAPI(str(directory / "s")).ping()


def test_dockerd_gone_after_negotiation_is_unreachable(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    client.ping()
    dockerd.stop()
    with pytest.raises(Unreachable):
        client.inspect_container("vbar")


def test_create_start_remove_send_the_engine_api_requests(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    dockerd.images.add("img:1")
    config = {"Image": "img:1", "HostConfig": {"Privileged": True, "Binds": ["/a:/b:ro"]}}
    ident = client.create_container("vbar", config)
    client.start_container(ident)
    client.start_container(ident)  # 304: already running
    assert dockerd.running("vbar")
    client.remove_container(ident, force=True)
    (create,) = dockerd.calls("POST", "/containers/create")
    assert create.query == {"name": "vbar"} and create.body == config
    assert len(dockerd.calls("POST", f"/containers/{ident}/start")) == 2
    (remove,) = dockerd.calls("DELETE", f"/containers/{ident}")
    assert remove.query == {"force": "true"}
    with pytest.raises(NotFound):
        client.inspect_container(ident)


def test_a_pull_reads_the_stream_to_its_end(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    client.pull_image("registry:5000/img", "2")
    client.pull_image("img", "sha256:" + "a" * 64)
    assert dockerd.pulls == [("registry:5000/img", "2"), ("img", "sha256:" + "a" * 64)]
    client.inspect_image("registry:5000/img:2")
    client.inspect_image("img@sha256:" + "a" * 64)


def test_a_pull_with_credentials_sends_them_in_x_registry_auth_only(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    auth = RegistryAuth("oauth2accesstoken", "ya29.token", "registry:5000")
    dockerd.registry_credentials["registry:5000"] = ("oauth2accesstoken", "ya29.token")
    client.pull_image("registry:5000/img", "2", auth)
    client.pull_image("other:5000/img", "2")
    first, second = dockerd.calls("POST", "/images/create")
    assert first.headers["X-Registry-Auth"] == auth_header(auth)
    assert "X-Registry-Auth" not in second.headers
    assert dockerd.pull_auths == [
        {"username": "oauth2accesstoken", "password": "ya29.token", "serveraddress": "registry:5000"},
        None,
    ]
    assert all("X-Registry-Auth" not in r.headers for r in dockerd.requests if "/images/create" not in r.path)
    assert "ya29.token" not in repr(auth)


def test_a_pull_resent_after_a_version_refusal_carries_its_credentials_again(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    client.ping()
    dockerd.api_version = "1.40"  # downgraded under the client: its 1.41 is now too new
    dockerd.registry_credentials["registry:5000"] = ("oauth2accesstoken", "ya29.token")
    client.pull_image(
        "registry:5000/img", "2", RegistryAuth("oauth2accesstoken", "ya29.token", "registry:5000")
    )
    refused, resent = dockerd.calls("POST", "/images/create")
    assert (refused.version, resent.version) == ("1.41", "1.40")
    assert refused.headers["X-Registry-Auth"] == resent.headers["X-Registry-Auth"]
    assert dockerd.pull_auths[-1] is not None


def test_a_pull_the_registry_refuses_is_an_api_error_with_dockerds_message(dockerd: FakeDockerd) -> None:
    dockerd.registry_credentials["registry:5000"] = ("oauth2accesstoken", "ya29.token")
    with pytest.raises(APIError) as caught:
        client_of(dockerd).pull_image("registry:5000/img", "2", RegistryAuth("oauth2accesstoken", "no", "x"))
    assert caught.value.status == 401
    assert caught.value.explanation == "unauthorized: authentication required"


def test_a_pull_failing_inside_a_200_stream_is_an_error(dockerd: FakeDockerd) -> None:
    dockerd.pull_error = "Get https://x/v2/: dial tcp: lookup x: no such host"
    with pytest.raises(APIError) as caught:
        client_of(dockerd).pull_image("x/img", "1")
    assert caught.value.explanation == dockerd.pull_error and caught.value.status == 200


def follow(stream: Any, into: list[dict[str, Any]], done: threading.Event) -> threading.Thread:
    def run() -> None:
        into.extend(stream)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_events_are_filtered_and_arrive_as_sent_until_dockerd_ends_the_stream(dockerd: FakeDockerd) -> None:
    client = client_of(dockerd)
    ident = dockerd.add_container("vbar", "img:1")
    other = dockerd.add_container("other", "img:1")
    events: list[dict[str, Any]] = []
    done = threading.Event()
    filters = {"type": ["container"], "container": [ident], "event": ["die"]}
    follow(client.events(filters), events, done)
    wait_until(lambda: len(dockerd.subscribers) == 1)
    (request,) = dockerd.calls("GET", "/events")
    assert json.loads(request.query["filters"]) == filters
    dockerd.die("other", 1)  # not this container
    dockerd.die("vbar", 137)
    wait_until(lambda: len(events) == 1)
    assert events[0]["Action"] == "die" and events[0]["Actor"]["Attributes"]["exitCode"] == "137"
    assert other not in json.dumps(events)
    dockerd.end_event_streams()
    assert done.wait(5)


def test_events_end_when_dockerd_goes_away(dockerd: FakeDockerd) -> None:
    stream = client_of(dockerd).events({"event": ["die"]})
    events: list[dict[str, Any]] = []
    done = threading.Event()
    follow(stream, events, done)
    wait_until(lambda: len(dockerd.subscribers) == 1)
    dockerd.stop()
    assert done.wait(5) and events == []


def test_closing_the_stream_from_another_thread_ends_a_blocked_read_at_once(dockerd: FakeDockerd) -> None:
    stream = client_of(dockerd).events({"event": ["die"]})
    events: list[dict[str, Any]] = []
    done = threading.Event()
    thread = follow(stream, events, done)
    wait_until(lambda: len(dockerd.subscribers) == 1)
    time.sleep(0.1)  # blocked in the read
    stream.close()
    # The fake sends nothing on the stream: a read the close did not end would block forever.
    assert done.wait(30) and events == []
    thread.join(30)
    assert dockerd.subscribers[0].closed_by_client.wait(30)  # dockerd sees the connection closed
    stream.close()  # twice is fine


def test_streamed_objects_split_or_joined_across_reads_come_out_whole() -> None:
    from tpuboot.containers.dockerwire import json_objects

    class Pieces:
        def __init__(self, *pieces: bytes) -> None:
            self.pieces = list(pieces)

        def read1(self, n: int) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    pieces = Pieces(b'{"a":', b'1}\n{"b"', b":2}\r\n\n", b'{"c":3}\n{"d":4}')
    assert list(json_objects(pieces)) == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}]  # type: ignore[arg-type]
