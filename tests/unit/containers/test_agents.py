"""Agents as data: a third agent is one Agent plus its configuration section, and the containers
service, doctor's container checks and prepare-image's pull step pick it up with no other change.
Also what the agents' modules import, and the container errors' place under TpubootError."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tpuboot import errors
from tpuboot.checks.containers import ContainerChecks
from tpuboot.checks.doctor import AskedOnce, NoServer
from tpuboot.component import Status
from tpuboot.config import Config, TelemetryConfig, VbarConfig, _PrivilegedImage, parse_registries
from tpuboot.configfields import option, parse_bool, parse_section, parse_str
from tpuboot.containers.agents import AGENTS, Agent, AgentSection
from tpuboot.containers.credentials import TokenUnavailable
from tpuboot.containers.docker import DockerEngine
from tpuboot.containers.dockerapi import DockerAPI
from tpuboot.containers.dockerwire import DockerError
from tpuboot.containers.engine import MANAGED_LABEL
from tpuboot.containers.service import Containers
from tpuboot.errors import ConfigError, TpubootError
from tpuboot.paths import Root
from tpuboot.prepare import Preparer
from tpuboot.references import ImageRefused, InvalidReference

REPO = Path(__file__).resolve().parents[3]
IMAGE = "example.invalid/stand-in:1"


@dataclass(frozen=True)
class StandInConfig(_PrivilegedImage):
    """The stand-in agent's section: the generic section of a supervised privileged image."""

    name = "standin"
    enabled: bool = option(True, parse_bool)
    image: str = option(IMAGE, parse_str)
    container_name: str = option("tpuboot-stand-in", parse_str)
    registries: tuple[str, ...] = option(("example.invalid",), parse_registries)


def stand_in(section: StandInConfig, *, gke_runs: bool = True) -> Agent:
    """The stand-in agent; its section as a YAML file would give it (Config has no field for it)."""

    def settings(config: Config) -> AgentSection:
        return section

    return Agent("stand-in", "standin", settings, "the stand-in agent", gke_runs=gke_runs)


#: vBar and the collector off: only the stand-in asks for a container.
OTHERS_OFF = Config(gke="false", vbar=VbarConfig(enabled=False), telemetry=TelemetryConfig(enabled=False))


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


def test_the_stand_in_section_parses_and_checks_like_any_agent_section() -> None:
    section = parse_section(StandInConfig, {"image": "example.invalid/other:2"}, "standin")
    assert (section.image, section.registries) == ("example.invalid/other:2", ("example.invalid",))
    with pytest.raises(ConfigError, match=r"registry gcr\.io not in standin\.registries"):
        parse_section(StandInConfig, {"image": "gcr.io/x/y:1"}, "standin")


def until_status(containers: Containers, reports: threading.Semaphore, done: Callable[[], bool]) -> None:
    """Wait for a status the component reports (each change releases ``reports``)."""
    while not done():
        assert reports.acquire(timeout=10), f"no change reported; statuses: {containers.statuses()}"


def test_the_service_supervises_a_third_agent(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    agent = stand_in(StandInConfig())
    containers = Containers(OTHERS_OFF, Root(dockerd.root), None, agents=(*AGENTS, agent))
    assert containers.enabled and list(containers.statuses()) == ["stand-in"]
    containers.tpu_vm_seen("a TPU is present")
    reports = threading.Semaphore(0)
    containers.start(reports.release)
    try:
        until_status(containers, reports, lambda: containers.statuses()["stand-in"].state == "running")
        assert containers.status() == Status("running", "stand-in: running")
    finally:
        containers.stop()
    made = dockerd.containers["tpuboot-stand-in"]
    assert made["Config"]["Image"] == IMAGE and made["Config"]["Labels"][MANAGED_LABEL] == "1"
    assert made["HostConfig"]["Privileged"] is True


def test_on_a_gke_node_an_agent_gke_does_not_run_still_starts(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    ours = stand_in(StandInConfig(), gke_runs=False)
    gkes = Agent(
        "gke's", "gkes", stand_in(StandInConfig(container_name="gke-runs-it")).settings, "GKE's agent"
    )
    config = OTHERS_OFF.replace(gke="true")
    containers = Containers(config, Root(dockerd.root), None, agents=(ours, gkes))
    containers.tpu_vm_seen("a TPU is present")
    reports = threading.Semaphore(0)
    containers.start(reports.release)
    try:
        until_status(containers, reports, lambda: containers.statuses()["stand-in"].state == "running")
        assert containers.statuses()["gke's"] == Status(
            "not started", "not started, GKE node (GKE runs GKE's agent)"
        )
    finally:
        containers.stop()
    assert list(dockerd.containers) == ["tpuboot-stand-in"]


def test_doctor_checks_a_third_agent() -> None:
    states = {"tpuboot-stand-in": "running"}
    agents = (*AGENTS, stand_in(StandInConfig()))
    checks = ContainerChecks(
        Root(Path("/nonexistent")), OTHERS_OFF, AskedOnce(NoServer(), 1.0),
        lambda root, name: states.get(name, "absent"), agents,
    )  # fmt: skip
    named = {criterion.name: check for criterion, check in checks.named()}
    assert list(named) == ["vbar-running", "telemetry-running", "standin-running", "vbar-endpoint"]
    result = named["standin-running"]()
    assert (result.status, result.detail) == ("PASS", "container tpuboot-stand-in is running")
    states.clear()
    result = named["standin-running"]()
    assert (result.status, result.detail) == ("FAIL", "container tpuboot-stand-in does not exist")
    assert "AGENT=stand-in" in (result.fix or "") and "the stand-in agent" in (result.fix or "")
    off = ContainerChecks(
        Root(Path("/nonexistent")), OTHERS_OFF, AskedOnce(NoServer(), 1.0), lambda r, n: "running",
        (stand_in(StandInConfig(enabled=False)),),
    )  # fmt: skip
    assert off.check(off.agents[0]).detail == "standin.enabled is false in the configuration"


def test_prepare_image_pulls_a_third_agents_image(dockerd: FakeDockerd) -> None:
    (dockerd.root / "run/systemd/system").mkdir(parents=True)
    agents = (*AGENTS, stand_in(StandInConfig()))

    def systemctl(*args: str) -> str:
        return "enabled\n" if "UnitFileState" in args else "inactive\n"

    results = Preparer(
        Root(dockerd.root), OTHERS_OFF, systemctl=systemctl,
        engine=lambda: DockerEngine(DockerAPI(str(dockerd.socket_path))), live=True, agents=agents,
    ).run()  # fmt: skip
    pulls = {r.name: r for r in results if r.name.startswith("pull-")}
    assert list(pulls) == ["pull-vbar", "pull-telemetry", "pull-standin"]
    assert (pulls["pull-standin"].status, pulls["pull-standin"].detail) == ("PASS", f"pulled {IMAGE}")
    assert dockerd.pulls == [("example.invalid/stand-in", "1")]


def test_the_container_errors_are_tpuboot_errors() -> None:
    for error in (DockerError, ImageRefused, InvalidReference, TokenUnavailable):
        assert issubclass(error, TpubootError), error
    assert issubclass(InvalidReference, ValueError)  # the config's validators take it as a bad value


def tpuboot_imports(path: str) -> set[str]:
    """The tpuboot modules a file imports, anywhere in it (inside functions too)."""
    tree = ast.parse((REPO / path).read_text())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    return {name for name in imported if name.startswith("tpuboot")}


def test_the_reference_grammar_imports_nothing_of_tpuboots_but_its_errors() -> None:
    assert tpuboot_imports("tpuboot/references.py") == {errors.__name__}
    assert tpuboot_imports("tpuboot/errors.py") == set()  # a leaf: no cycle through it


@pytest.mark.parametrize(
    "module", ["tpuboot.checks.containers", "tpuboot.containers.agents", "tpuboot.config"]
)
def test_the_agents_labels_and_the_container_checks_load_no_prometheus_client(module: str) -> None:
    """tpuboot/derived.py and doctor read the agents' labels, and doctor runs the container checks, without
    the supervisor's metrics; a config naming images and token registries reaches no engine."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import {module}; "
        "from tpuboot.config import parse_config; "
        "parse_config('vbar: {image: gcr.io/a/b:1}\\nregistry_auth: {token_registries: [gcr.io]}\\n', 'f'); "
        "print(' '.join(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert "prometheus_client" not in loaded
    assert "tpuboot.containers.supervisor" not in loaded and "tpuboot.containers.service" not in loaded
    if module == "tpuboot.config":
        assert not {name for name in loaded if name.startswith("tpuboot.containers")}
