"""The registry allowlist of the privileged containers: parsing as dockerd does, lookalikes refused,
and what the supervisor does with a refused image (nothing pulled or run; one STATUS line)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.polling import wait_until
from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import Statuses, engine_of
from tpuboot.backoff import RestartPolicy
from tpuboot.config import DEFAULT_REGISTRIES, Config, TelemetryConfig, VbarConfig, parse_config
from tpuboot.containers.engine import ContainerSpec
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.runtime import EngineRuntime, runtime_on
from tpuboot.containers.service import Containers
from tpuboot.containers.supervisor import Refused, Supervisor
from tpuboot.errors import ConfigError
from tpuboot.paths import Root
from tpuboot.references import (
    ImageRefused,
    InvalidReference,
    RegistryAllowlist,
    parse_entry,
    parse_image,
)

TOP = Path(__file__).parents[2]
DEFAULT = RegistryAllowlist(DEFAULT_REGISTRIES, "vbar.registries")
DIGEST = "sha256:" + "0123456789abcdef" * 4


# --- parsing: the registry and path dockerd would use -------------------------------------------

PARSED = [
    (
        "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1",
        "gcr.io",
        "cloud-tpu-v2-images/vbar_control_agent",
    ),
    ("us-docker.pkg.dev/p/repo/img", "us-docker.pkg.dev", "p/repo/img"),
    (f"gcr.io/p/img:1@{DIGEST}", "gcr.io", "p/img"),
    (f"gcr.io/p/img@{DIGEST}", "gcr.io", "p/img"),
    ("busybox", "docker.io", "library/busybox"),
    ("busybox:1", "docker.io", "library/busybox"),
    ("tpuboot-test/vbar:1", "docker.io", "tpuboot-test/vbar"),
    ("docker.io/busybox", "docker.io", "library/busybox"),
    ("index.docker.io/user/img", "docker.io", "user/img"),
    ("gcr.io", "docker.io", "library/gcr.io"),  # no slash: a Docker Hub name, not a registry
    ("gcr.io:5000", "docker.io", "library/gcr.io"),  # and :5000 its tag
    ("localhost/img", "localhost", "img"),
    ("localhost:5000/img", "localhost:5000", "img"),
    ("127.0.0.1:5000/img", "127.0.0.1:5000", "img"),
    ("[::1]:5000/img", "[::1]:5000", "img"),
    ("GCR.IO/p/img", "GCR.IO", "p/img"),  # upper case: a registry (dockerd's rule), not gcr.io
    ("Registry/img", "Registry", "img"),
    ("123/img", "docker.io", "123/img"),  # digits only: a Docker Hub user
    ("a.b/c__d-e.f/g", "a.b", "c__d-e.f/g"),
]


@pytest.mark.parametrize(("image", "registry", "path"), PARSED)
def test_parse_image_finds_the_registry_dockerd_would(image: str, registry: str, path: str) -> None:
    ref = parse_image(image)
    assert (ref.registry, ref.path) == (registry, path)


# --- lookalikes: refused by the default allowlist, each for the reason given -------------------------

INVALID = "not a valid image reference"

LOOKALIKES = [
    ("gcr.io.evil.com/cloud-tpu-v2-images/vbar:1", "registry gcr.io.evil.com"),
    ("evil.com/gcr.io/cloud-tpu-v2-images/vbar:1", "registry evil.com"),
    ("evil.com/us-docker.pkg.dev/p/vbar", "registry evil.com"),
    ("us-docker.pkg.dev.evil.com/p/vbar", "registry us-docker.pkg.dev.evil.com"),
    ("evil-us-docker.pkg.dev/p/vbar", "registry evil-us-docker.pkg.dev"),
    ("xgcr.io/p/vbar", "registry xgcr.io"),
    ("europe-docker.pkg.dev/p/vbar", "registry europe-docker.pkg.dev"),
    ("docker.io/gcr.io/vbar", "registry docker.io"),
    ("gcr.io", "registry docker.io"),
    ("gcr.io:latest", "registry docker.io"),
    ("gcr/io/vbar", "registry docker.io"),
    ("GCR.IO/cloud-tpu-v2-images/vbar:1", "registry GCR.IO"),
    ("Gcr.io/cloud-tpu-v2-images/vbar:1", "registry Gcr.io"),
    ("gcr.io:443/cloud-tpu-v2-images/vbar:1", "registry gcr.io:443"),
    ("gcr.io:5000/p/vbar", "registry gcr.io:5000"),
    ("localhost/vbar", "registry localhost"),
    ("127.0.0.1/vbar", "registry 127.0.0.1"),
    ("[::1]/vbar", "registry [::1]"),
    ("gcr.io./p/vbar", INVALID),  # trailing dot
    ("gcr.io../p/vbar", INVALID),
    (".gcr.io/p/vbar", INVALID),
    ("gcr.io@evil.com/p/vbar", INVALID),  # userinfo
    ("user@gcr.io/p/vbar", INVALID),
    ("user:pass@gcr.io/p/vbar", INVALID),
    ("https://gcr.io/p/vbar", INVALID),  # a scheme
    ("//gcr.io/p/vbar", INVALID),
    ("gcr.io:/p/vbar", INVALID),
    ("gcr.io//p/vbar", INVALID),
    ("gcr.io/../evil/vbar", INVALID),
    ("gcr.io/p/vbar/", INVALID),
    ("gcr.io/P/vbar", INVALID),  # a repository path is lower case
    ("gcr.io/p/vbar:", INVALID),
    ("gcr.io/p/vbar:-1", INVALID),
    ("gcr.io/p/vbar@sha256:abc", INVALID),  # a digest is 32 hex digits at least
    (" gcr.io/p/vbar", INVALID),
    ("gcr.io/p/vbar ", INVALID),
    ("gcr.io/p/vbar\n", INVALID),  # a regex's $ would let this through
    ("gcr.io/p/vbar\nevil.com/x", INVALID),
    ("gcr.io/p/vbar\x00", INVALID),
    ("gcr\u0456o/p/vbar", INVALID),  # a Cyrillic i (U+0456)
    ("\uff47cr.io/p/vbar", INVALID),  # a fullwidth g
    ("gcr.io/p/vbar:t\u0430g", INVALID),  # Python's \w would take it
    ("gcr.io/p/vbar:\u0661", INVALID),  # an Arabic-Indic digit
    ("xn--gcr-io.com/p/vbar", "registry xn--gcr-io.com"),
    ("*.gcr.io/p/vbar", INVALID),
    ("gcr.io\\p\\vbar", INVALID),
    ("gcr.io/" + "a" * 250, INVALID),  # longer than dockerd's 255
    ("", INVALID),
]


@pytest.mark.parametrize(("image", "why"), LOOKALIKES)
def test_lookalikes_are_refused(image: str, why: str) -> None:
    with pytest.raises(ImageRefused) as refused:
        DEFAULT.check(image, "tpu-env's VBARCONTROL_AGENT_DOCKER_URL")
    message = str(refused.value)
    assert "\n" not in message and "\x00" not in message and len(message) < 300
    if why == INVALID:
        assert message.endswith(f"refused: {INVALID}; fix tpu-env's VBARCONTROL_AGENT_DOCKER_URL")
        assert message.startswith("image '")  # quoted: what was given, escaped
    else:
        assert message == f"image {image} refused: {why} not in vbar.registries; add it there if you trust it"


@pytest.mark.parametrize(
    "image",
    [
        "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1",
        "gcr.io/cloud-tpu-v2-images/ai-telemetry-collector:latest",
        "us-docker.pkg.dev/cloud-tpu-v2-images/vbar/vbar_control_agent:1",
        f"gcr.io/cloud-tpu-v2-images/vbar_control_agent@{DIGEST}",
        f"us-docker.pkg.dev/p/r/img:tag@{DIGEST}",
    ],
)
def test_the_documented_images_are_allowed_by_default(image: str) -> None:
    assert DEFAULT.check(image).text == image


def test_the_default_is_the_registries_of_the_documented_procedure() -> None:
    """The procedure (reference 000_52d0c664a5d34bd1) pulls from gcr.io after configuring
    us-docker.pkg.dev; the shipped defaults are those two, and both images are in them."""
    assert DEFAULT_REGISTRIES == ("gcr.io", "us-docker.pkg.dev")
    config = Config()
    assert config.vbar.registries == config.telemetry.registries == DEFAULT_REGISTRIES
    VbarConfig().check("f: vbar")
    TelemetryConfig().check("f: telemetry")


PREFIXED = RegistryAllowlist(["gcr.io/cloud-tpu-v2-images", "docker.io/tpuboot-test", "localhost:5000"], "k")


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("gcr.io/cloud-tpu-v2-images/vbar:1", True),
        ("gcr.io/cloud-tpu-v2-images/sub/vbar:1", True),
        ("gcr.io/cloud-tpu-v2-images-evil/vbar:1", False),  # a prefix ends at a component
        ("gcr.io/cloud-tpu-v2-imagesx/vbar:1", False),
        ("gcr.io/cloud-tpu/vbar:1", False),
        ("gcr.io/other/vbar:1", False),
        ("gcr.io/cloud-tpu-v2-images", True),  # the prefix itself names a repository
        ("tpuboot-test/vbar:1", True),
        ("docker.io/tpuboot-test/vbar:1", True),
        ("index.docker.io/tpuboot-test/vbar:1", True),
        ("tpuboot-testx/vbar:1", False),
        ("busybox", False),
        ("localhost:5000/anything/at/all", True),
        ("localhost/anything", False),
    ],
)
def test_entries_with_a_path_prefix(image: str, allowed: bool) -> None:
    assert PREFIXED.allows(parse_image(image)) is allowed


def test_a_refusal_under_a_listed_host_names_the_repository() -> None:
    with pytest.raises(
        ImageRefused, match=r"^image gcr.io/other/vbar:1 refused: repository gcr.io/other/vbar not"
    ):
        PREFIXED.check("gcr.io/other/vbar:1")


def test_parse_image_raises_invalid_reference() -> None:
    with pytest.raises(InvalidReference):
        parse_image("gcr.io./x")


# --- the configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("GCR.IO", "in lowercase"),
        ("https://gcr.io", "not a registry"),
        ("gcr.io/", "repository path"),
        ("gcr.io/Upper", "repository path"),
        ("*.pkg.dev", "not a registry"),
        ("gcr.io.", "not a registry"),
        ("", "not a registry"),
        ("index.docker.io", "write Docker Hub as docker.io"),
        ("user@gcr.io", "not a registry"),
    ],
)
def test_an_entry_that_could_never_match_is_refused_at_load(entry: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=rf"^f: vbar.registries\[1\]: .*{problem}"):
        parse_config(f"vbar: {{registries: [gcr.io, {entry!r}]}}", "f")
    with pytest.raises(ValueError, match=problem):
        parse_entry(entry)


@pytest.mark.parametrize("value", ["[]", "gcr.io", "[1]", "null"])
def test_registries_must_be_a_non_empty_list_of_hosts(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^f: telemetry.registries"):
        parse_config(f"telemetry: {{registries: {value}}}", "f")


def test_a_configured_image_its_own_allowlist_refuses_is_refused_at_load() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config("vbar: {image: 'tpuboot-test/vbar:1'}", "/etc/tpuboot/tpuboot.yaml")
    assert str(refused.value) == (
        "/etc/tpuboot/tpuboot.yaml: vbar.image: image tpuboot-test/vbar:1 refused: registry docker.io "
        "not in vbar.registries; add it there if you trust it, or change vbar.image"
    )
    with pytest.raises(ConfigError, match=r"^f: telemetry.image: image 'a b' refused: not a valid"):
        parse_config("telemetry: {image: 'a b'}", "f")
    allowed = parse_config("vbar: {image: 'tpuboot-test/vbar:1', registries: [docker.io/tpuboot-test]}", "f")
    assert allowed.vbar.registries == ("docker.io/tpuboot-test",)


def test_the_shipped_file_lists_every_key_of_the_container_sections_with_its_default() -> None:
    """As test_packaging checks for vfio, metadata and env: each key commented, with a line of why."""
    text = (TOP / "conf/tpuboot.yaml").read_text()
    for section in ("vbar", "telemetry", "supervisor"):
        cls = type(getattr(Config(), section))
        assert re.search(rf"^#{section}:$", text, re.MULTILINE), section
        for name in cls.options:
            assert re.search(rf"^  # (.+)\n(  # .+\n)*  #{name}:", text, re.MULTILINE), f"{section}.{name}"
    assert re.search(r"^#gke: auto$", text, re.MULTILINE)
    assert re.search(r"^  #registries: \[gcr\.io, us-docker\.pkg\.dev\]$", text, re.MULTILINE)
    uncommented = "\n".join(re.sub(r"^(\s*)#(?=\S)", r"\1", line) for line in text.splitlines())
    assert parse_config(uncommented, "tpuboot.yaml") == Config()


# --- the supervisor: nothing pulled or run, one STATUS line, a wait for another value ------------


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


def runtime_for(dockerd: FakeDockerd, image: list[str]) -> EngineRuntime:
    return runtime_on(
        HOST_ENGINE,
        Root(dockerd.root),
        lambda: ContainerSpec("vbar", image[0], origin="tpu-env's VBARCONTROL_AGENT_DOCKER_URL"),
        pull_retries=1,
        client=engine_of(dockerd),
        pause=lambda s: None,
        allowlist=DEFAULT,
    )


def test_a_refused_image_is_neither_pulled_nor_run_nor_even_asked_about(dockerd: FakeDockerd) -> None:
    evil = "evil.example/vbar:1"
    dockerd.images.add(evil)
    dockerd.add_container("vbar", evil)  # even one already running is not adopted
    runtime = runtime_for(dockerd, [evil])
    with pytest.raises(Refused):
        runtime.start()
    assert dockerd.requests == [] and dockerd.pulls == []


def test_the_supervisor_says_why_once_and_waits_for_another_value(
    dockerd: FakeDockerd, caplog: pytest.LogCaptureFixture
) -> None:
    good = "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1"
    dockerd.images.add(good)
    image = ["evil.example/vbar:1"]
    status = Statuses()
    supervisor = Supervisor("vBar", runtime_for(dockerd, image), RestartPolicy(0.01, 0.02, 30.0), status)
    caplog.set_level(logging.WARNING, logger="tpuboot")
    supervisor.start()
    try:
        expected = (
            "vBar: image evil.example/vbar:1 refused: registry evil.example not in vbar.registries; "
            "add it there if you trust it"
        )
        wait_until(lambda: status.last == expected)
        supervisor.reconfigure()  # another tpu-env change, the same image: nothing new to try
        supervisor.reconfigure()
        time.sleep(0.3)  # the policy's maximum is 0.02 s: a timer retry would have come many times
        assert status.lines == [expected] and supervisor.starts == 0
        assert dockerd.requests == [] and dockerd.pulls == []
        warnings = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert getattr(warnings[0], "IMAGE", None) == "evil.example/vbar:1"  # a journal field

        image[0] = good  # a new value from metadata
        supervisor.reconfigure()
        wait_until(lambda: status.last == "vBar: running")
        assert dockerd.image_of("vbar") == good

        image[0] = "evil.example/vbar:2"  # and refused again: the running one is left as it is
        supervisor.reconfigure()
        wait_until(lambda: "refused" in status.last)
        assert dockerd.image_of("vbar") == good and dockerd.pulls == []
    finally:
        supervisor.stop(timeout=5)
    assert not supervisor._thread or not supervisor._thread.is_alive()


def test_stop_ends_a_supervisor_waiting_after_a_refusal(dockerd: FakeDockerd) -> None:
    status = Statuses()
    supervisor = Supervisor("vBar", runtime_for(dockerd, ["evil.example/v"]), RestartPolicy(1, 1, 1), status)
    supervisor.start()
    wait_until(lambda: "refused" in status.last)
    # After a refusal it waits for another wanted image, which never comes here: a thread that
    # stop did not wake would still be waiting when the generous join gives up.
    supervisor.stop(timeout=30)
    assert supervisor._thread is not None and not supervisor._thread.is_alive()


def test_a_value_that_is_not_a_reference_is_one_status_line(dockerd: FakeDockerd) -> None:
    status = Statuses()
    hostile = "gcr.io/cloud-tpu-v2-images/vbar:1\nINJECTED=1; vBar: running"
    supervisor = Supervisor("vBar", runtime_for(dockerd, [hostile]), RestartPolicy(1, 1, 1), status)
    supervisor.start()
    try:
        wait_until(lambda: "refused" in status.last)
        assert "\n" not in status.last
        assert status.last == (
            "vBar: image 'gcr.io/cloud-tpu-v2-images/vbar:1\\nINJECTED=1; vBar: running' refused: "
            "not a valid image reference; fix tpu-env's VBARCONTROL_AGENT_DOCKER_URL"
        )
    finally:
        supervisor.stop(timeout=5)


def test_the_containers_refuse_a_tpu_env_image_outside_vbar_registries(dockerd: FakeDockerd) -> None:
    """End to end through Containers: the STATUS text the daemon shows, nothing pulled."""
    config = Config(gke="false")
    dockerd.images.add("attacker.example/vbar:1")
    values = {"VBARCONTROL_AGENT_DOCKER_URL": "attacker.example/vbar:1"}
    containers = Containers(config, Root(dockerd.root), None, tpu_env=lambda: values)
    containers.tpu_vm_seen("a TPU is present")
    containers.start(lambda: None)
    try:
        wait_until(lambda: containers.statuses()["vBar"].state == "refused")
        assert containers.status().detail == (
            "vBar: image attacker.example/vbar:1 refused: registry attacker.example not in "
            "vbar.registries; add it there if you trust it"
        )
        assert dockerd.requests == []
    finally:
        containers.stop()
