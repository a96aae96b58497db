"""Registry credentials from the VM's service account (tpuboot/containers/credentials.py).

The token comes from the metadata emulator through the real metadata client; pulls go to the
fake dockerd, which decodes ``X-Registry-Auth`` as dockerd does and plays a registry that takes
one user and password.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator

import pytest

from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.dockerd import FakeDockerd, decode_registry_auth, fake_dockerd
from tests.unit.helpers.containers import (
    GCR_IMAGE,
    TOKEN,
    Clock,
    client_of,
    credentials,
    runtime,
    token_answer,
)
from tpuboot.config import DEFAULT_TOKEN_REGISTRIES, Config, RegistryAuthConfig, TelemetryConfig, parse_config
from tpuboot.containers.credentials import (
    EARLY_EXPIRY,
    TOKEN_USERNAME,
    TokenRegistries,
    parse_host_pattern,
)
from tpuboot.containers.dockerapi import auth_header
from tpuboot.containers.engine import RegistryAuth
from tpuboot.containers.service import Containers
from tpuboot.containers.supervisor import RUNNING, CannotStart
from tpuboot.errors import ConfigError
from tpuboot.gce.keys import SERVICE_ACCOUNT_TOKEN as TOKEN_PATH
from tpuboot.paths import Root

#: A value the tests put where the token would be, to see it is never repeated in a message.
SECRET = "ya29.secret-never-shown"


@pytest.fixture
def emulator() -> Iterator[MetadataEmulator]:
    with MetadataEmulator(instance={"service-accounts/default/token": token_answer()}) as mds:
        yield mds


def token_requests(emulator: MetadataEmulator) -> int:
    return emulator.request_count


# --- which registries get the token ----------------------------------------------------------


@pytest.mark.parametrize(
    "registry",
    ["gcr.io", "us.gcr.io", "eu.gcr.io", "asia.gcr.io", "marketplace.gcr.io", "us-docker.pkg.dev",
     "us-central1-docker.pkg.dev", "europe-west4-docker.pkg.dev"],
)  # fmt: skip
def test_googles_registries_get_the_token(registry: str) -> None:
    assert TokenRegistries(DEFAULT_TOKEN_REGISTRIES).matches(registry)


@pytest.mark.parametrize(
    "registry",
    [
        "gcr.io.evil.example",  # a suffix of someone else's
        "evilgcr.io",  # the wildcard stands for a whole label before ".gcr.io"
        "a.b.gcr.io",  # one label only
        ".gcr.io",
        "gcr.io:443",  # compared as written, port included
        "us.gcr.io:8443",
        "GCR.IO",
        "Us.gcr.io",
        "docker.pkg.dev",
        "-docker.pkg.dev",
        "us--docker.pkg.dev.evil.example",
        "us-docker.pkg.dev.evil.example",
        "evil.example-docker.pkg.dev.evil",
        "a.b-docker.pkg.dev",
        "pkg.dev",
        "docker.io",
        "localhost:5000",
        "[::1]:5000",
    ],
)
def test_other_hosts_never_get_it(registry: str) -> None:
    assert not TokenRegistries(DEFAULT_TOKEN_REGISTRIES).matches(registry)


@pytest.mark.parametrize(
    ("image", "sent"),
    [
        ("gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1", True),
        ("us-docker.pkg.dev/project/repo/vbar@sha256:" + "a" * 64, True),
        ("gcr.io.evil.example/cloud-tpu-v2-images/vbar:1", False),
        ("evil.example/gcr.io/vbar:1", False),  # gcr.io in the path: the registry is evil.example
        ("evil.example:443/gcr.io/x", False),
        ("gcr.io", False),  # one component: Docker Hub's library/gcr.io
        ("gcr.io:443/x/y", False),
        ("oauth2accesstoken:x@evil.example/y", False),  # userinfo: not a reference dockerd takes
        ("gcr.io@evil.example/x", False),
        ("https://gcr.io/x", False),
        ("evil.example/x:gcr.io", False),
        ("GCR.IO/x", False),
        ("gcr.io./x", False),
    ],
)
def test_the_token_goes_only_where_dockerd_will_pull_from(
    emulator: MetadataEmulator, image: str, sent: bool
) -> None:
    pull = credentials(emulator).for_image(image)
    assert (pull.auth is not None) is sent
    assert pull.missing == ""
    assert token_requests(emulator) == (1 if sent else 0)  # nothing asked for a host that gets nothing


@pytest.mark.parametrize("entry", ["gcr.io", "*.gcr.io", "*-docker.pkg.dev", "localhost:5000", "[::1]:5000",
                                   "registry.example:5000", "*.registry.example:5000"])  # fmt: skip
def test_valid_entries(entry: str) -> None:
    parse_host_pattern(entry)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("*", "two labels or more"),
        ("*.io", "two labels or more"),
        ("*gcr.io", "start of the first label"),
        ("gcr.*", "may only start"),
        ("*.*.gcr.io", "may only start"),
        ("GCR.IO", "lowercase"),
        ("gcr.io/project", "without a path"),
        ("https://gcr.io", "is not a registry host"),
        ("", "is not a registry host"),
        ("index.docker.io", "docker.io"),
    ],
)
def test_entries_refused_with_the_fix(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_host_pattern(entry)


def test_configuration_key_default_empty_and_refusals() -> None:
    assert Config().registry_auth.token_registries == ("gcr.io", "*.gcr.io", "*-docker.pkg.dev")
    assert parse_config("registry_auth:\n  token_registries: []\n", "f").registry_auth == RegistryAuthConfig(
        token_registries=()
    )
    config = parse_config("registry_auth:\n  token_registries: [localhost:5000, '*.gcr.io']\n", "f")
    assert config.registry_auth.token_registries == ("localhost:5000", "*.gcr.io")
    with pytest.raises(ConfigError, match=r"f: registry_auth.token_registries\[1\]: '\*.io': '\*' must"):
        parse_config("registry_auth:\n  token_registries: [gcr.io, '*.io']\n", "f")
    with pytest.raises(ConfigError, match=r"registry_auth.token_registries: expected a list"):
        parse_config("registry_auth:\n  token_registries: gcr.io\n", "f")
    with pytest.raises(ConfigError, match=r"unknown key 'token_hosts'"):
        parse_config("registry_auth:\n  token_hosts: []\n", "f")


def test_an_empty_list_sends_the_token_nowhere(emulator: MetadataEmulator) -> None:
    assert credentials(emulator, ()).for_image("gcr.io/x/y:1").auth is None
    assert token_requests(emulator) == 0


# --- the token: fetched, kept, renewed -------------------------------------------------------


def test_the_token_is_the_password_of_oauth2accesstoken_for_that_registry(emulator: MetadataEmulator) -> None:
    auth = credentials(emulator).for_image("us-central1-docker.pkg.dev/p/r/vbar:1").auth
    assert auth == RegistryAuth(TOKEN_USERNAME, TOKEN, "us-central1-docker.pkg.dev")
    assert TOKEN not in repr(auth)


def test_the_token_is_kept_until_shortly_before_it_expires(emulator: MetadataEmulator) -> None:
    clock = Clock()
    source = credentials(emulator, clock=clock)
    for _ in range(3):
        assert source.for_image("gcr.io/x/y:1").auth is not None
    assert token_requests(emulator) == 1
    clock.now += 3599 - EARLY_EXPIRY - 1
    source.for_image("us.gcr.io/x/y:1")
    assert token_requests(emulator) == 1
    emulator.set(TOKEN_PATH, token_answer("ya29.renewed"))
    clock.now += 2
    auth = source.for_image("gcr.io/x/y:1").auth
    assert auth is not None and auth.password == "ya29.renewed"
    assert token_requests(emulator) == 2


def test_a_token_about_to_expire_is_used_once_not_kept(emulator: MetadataEmulator) -> None:
    emulator.set(TOKEN_PATH, token_answer(expires_in=int(EARLY_EXPIRY)))
    source = credentials(emulator)
    assert source.for_image("gcr.io/x/y:1").auth is not None
    assert source.for_image("gcr.io/x/y:1").auth is not None
    assert token_requests(emulator) == 2


def test_a_refused_token_is_forgotten_but_not_a_newer_one(emulator: MetadataEmulator) -> None:
    source = credentials(emulator)
    first = source.for_image("gcr.io/x/y:1").auth
    assert first is not None
    source.forget(RegistryAuth(TOKEN_USERNAME, "ya29.some-older-token", "gcr.io"))
    source.for_image("gcr.io/x/y:1")
    assert token_requests(emulator) == 1
    source.forget(first)
    source.for_image("gcr.io/x/y:1")
    assert token_requests(emulator) == 2


# --- no token: anonymous, one line -----------------------------------------------------------


def test_no_service_account_pulls_without_credentials_and_says_why(
    emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    emulator.set(TOKEN_PATH, None)
    caplog.set_level(logging.INFO, "tpuboot.containers.credentials")
    source = credentials(emulator)
    for _ in range(3):
        pull = source.for_image("gcr.io/x/y:1")
        assert pull.auth is None
        assert pull.missing == (
            "no service-account token: the metadata server has no "
            "instance/service-accounts/default/token: the VM has no service account"
        )
    said = [r.getMessage() for r in caplog.records if r.name == "tpuboot.containers.credentials"]
    assert said == [
        "no service-account token for gcr.io (the metadata server has no "
        "instance/service-accounts/default/token: the VM has no service account); "
        "pulling gcr.io/x/y:1 without credentials"
    ]
    emulator.set(TOKEN_PATH, token_answer())
    assert source.for_image("gcr.io/x/y:1").auth is not None
    said = [r.getMessage() for r in caplog.records if r.name == "tpuboot.containers.credentials"]
    assert said[1:] == ["service-account token available again for pulls from gcr.io"]


def test_a_silent_metadata_server_means_an_anonymous_pull_within_the_deadline(
    emulator: MetadataEmulator,
) -> None:
    source = credentials(emulator)
    emulator.stop()
    pull = source.for_image("gcr.io/x/y:1")
    assert pull.auth is None
    assert pull.missing.startswith("no service-account token: metadata server http://127.0.0.1:")
    assert "check the VM's network" in pull.missing


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (f"<html>{SECRET}</html>", "is not JSON"),
        (json.dumps([SECRET]), "is not a JSON object"),
        (json.dumps({"token": SECRET}), "has no access_token"),
        (json.dumps({"access_token": ""}), "has no access_token"),
        (json.dumps({"access_token": SECRET + " x"}), "is not a token"),
        (json.dumps({"access_token": SECRET + "\n"}), "is not a token"),
        (json.dumps({"access_token": "y" * 9000}), "is not a token"),
        (json.dumps({"access_token": SECRET, "token_type": "MAC"}), "is not a Bearer token"),
        (json.dumps({"access_token": SECRET, "expires_in": "soon"}), "expires_in that is not seconds"),
        (json.dumps({"access_token": SECRET, "expires_in": True}), "expires_in that is not seconds"),
        (json.dumps({"access_token": SECRET, "expires_in": -5}), "expires_in that is not seconds"),
    ],
)
def test_a_malformed_answer_is_no_token_and_is_never_quoted(
    emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture, body: str, why: str
) -> None:
    emulator.set(TOKEN_PATH, body)
    pull = credentials(emulator).for_image("gcr.io/x/y:1")
    assert pull.auth is None
    assert why in pull.missing
    assert SECRET not in pull.missing and SECRET not in caplog.text


def test_a_token_type_in_lower_case_and_no_expiry_are_taken(emulator: MetadataEmulator) -> None:
    emulator.set(TOKEN_PATH, json.dumps({"access_token": TOKEN, "token_type": "bearer"}))
    source = credentials(emulator)
    assert source.for_image("gcr.io/x/y:1").auth is not None
    source.for_image("gcr.io/x/y:1")
    assert token_requests(emulator) == 2  # no expires_in: not kept


# --- the header dockerd decodes --------------------------------------------------------------


@pytest.mark.parametrize("password", [TOKEN, "a", "ab", "abc", "\u00ff\u00fe>>>???", "p+/=&"])
def test_x_registry_auth_is_padded_base64url_json_as_dockerd_decodes_it(password: str) -> None:
    header = auth_header(RegistryAuth(TOKEN_USERNAME, password, "gcr.io"))
    assert "+" not in header and "/" not in header and len(header) % 4 == 0
    assert decode_registry_auth(header) == {
        "username": TOKEN_USERNAME,
        "password": password,
        "serveraddress": "gcr.io",
    }


def test_the_fake_reads_what_dockerd_cannot_decode_as_no_credentials() -> None:
    data = json.dumps({"username": "u", "password": "p?>."}).encode()
    padded = base64.urlsafe_b64encode(data).decode()
    assert padded.endswith("=") and "_" in padded  # a padded value with a URL-safe character
    assert decode_registry_auth(padded) == {"username": "u", "password": "p?>."}
    assert decode_registry_auth(base64.b64encode(data).decode()) is None  # the standard alphabet
    assert decode_registry_auth(padded.rstrip("=")) is None  # unpadded
    assert decode_registry_auth(base64.urlsafe_b64encode(b"[1]").decode()) is None
    assert decode_registry_auth(None) is None


# --- pulls through the docker runtime ---------------------------------------------------------

OTHER_IMAGE = "registry.example:5000/vbar:1"


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        fake.registry_credentials["gcr.io"] = (TOKEN_USERNAME, TOKEN)
        yield fake


def test_a_pull_from_gcr_sends_the_token_and_the_container_starts(
    dockerd: FakeDockerd, emulator: MetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    started = runtime(dockerd, GCR_IMAGE, credentials(emulator)).start()
    assert started.how == "started"
    assert dockerd.pull_auths == [{"username": TOKEN_USERNAME, "password": TOKEN, "serveraddress": "gcr.io"}]
    assert (
        "pulled gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1 with the VM's service-account token"
        in (caplog.text)
    )
    assert TOKEN not in caplog.text


def test_a_pull_from_another_registry_sends_no_header_at_all(
    dockerd: FakeDockerd, emulator: MetadataEmulator
) -> None:
    runtime(dockerd, OTHER_IMAGE, credentials(emulator)).start()
    (pull,) = dockerd.calls("POST", "/images/create")
    assert "X-Registry-Auth" not in pull.headers
    assert token_requests(emulator) == 0


def test_without_credentials_a_token_registry_refuses_and_the_message_says_so(dockerd: FakeDockerd) -> None:
    with pytest.raises(CannotStart) as caught:
        runtime(dockerd, GCR_IMAGE, None).start()
    assert "no basic auth credentials" in str(caught.value)
    assert dockerd.pull_auths == [None, None]


def test_a_refused_token_is_asked_for_again_and_the_message_names_the_fix(
    dockerd: FakeDockerd, emulator: MetadataEmulator
) -> None:
    emulator.set(TOKEN_PATH, token_answer("ya29.a-token-the-registry-refuses"))
    with pytest.raises(CannotStart) as caught:
        runtime(dockerd, GCR_IMAGE, credentials(emulator)).start()
    message = str(caught.value)
    assert message == (
        f"cannot pull image {GCR_IMAGE} (2 tries: unauthorized: authentication required); the registry "
        "refused the VM's service-account token: grant the service account read access "
        "(roles/artifactregistry.reader) and give the VM a scope that allows it (--scopes=cloud-platform); "
        "make it reachable, load it with `docker load`, or set another image"
    )
    assert "ya29.a-token" not in message
    assert token_requests(emulator) == 2  # refused: the second try asked the metadata server again


def test_a_token_that_comes_back_is_used_by_the_next_try(
    dockerd: FakeDockerd, emulator: MetadataEmulator
) -> None:
    emulator.set(TOKEN_PATH, None)
    source = credentials(emulator)
    with pytest.raises(CannotStart) as caught:
        runtime(dockerd, GCR_IMAGE, source).start()
    assert str(caught.value).endswith(
        "no basic auth credentials); pulled without credentials (no service-account token: the metadata "
        "server has no instance/service-accounts/default/token: the VM has no service account); "
        "make it reachable, load it with `docker load`, or set another image"
    )
    emulator.set(TOKEN_PATH, token_answer())
    assert runtime(dockerd, GCR_IMAGE, source).start().how == "started"
    assert dockerd.pull_auths[-1] == {
        "username": TOKEN_USERNAME,
        "password": TOKEN,
        "serveraddress": "gcr.io",
    }


def test_the_daemons_containers_pull_both_images_with_one_token(
    dockerd: FakeDockerd, emulator: MetadataEmulator
) -> None:
    """Containers (tpuboot/containers/service.py) hands both runtimes one source: one token fetch."""
    config = Config(gke="false", telemetry=TelemetryConfig(enabled=True))
    assert config.vbar.image.startswith("gcr.io/") and config.telemetry.image.startswith("gcr.io/")
    containers = Containers(config, Root(dockerd.root), client_of(emulator))
    containers.tpu_vm_seen("a TPU is present")
    containers.start(lambda: None)
    try:
        wait_until(lambda: all(s.state == RUNNING for s in containers.statuses().values()))
    finally:
        containers.stop()
    assert set(containers.statuses()) == {"vBar", "telemetry"}
    wanted = {"username": TOKEN_USERNAME, "password": TOKEN, "serveraddress": "gcr.io"}
    assert dockerd.pull_auths == [wanted, wanted]
    assert token_requests(emulator) == 1
