"""The agents tpuboot supervises, as data: each one an :class:`Agent`, all of them :data:`AGENTS`.

The containers service (:mod:`tpuboot.containers.service`), doctor's container checks
(:mod:`tpuboot.checks.containers`) and prepare-image's pull step iterate :data:`AGENTS` and ask
nothing else about an agent: a third one is an :class:`Agent` here plus its section in the
configuration (a ``_PrivilegedImage`` section: enabled, image, container_name, registries).

vBar's image is tpu-env's ``VBARCONTROL_AGENT_DOCKER_URL`` when set and not empty, else
``vbar.image`` (:attr:`Agent.image_key`). tpu-env is the values tpuboot itself parsed, never the
tpu-env file: whoever chooses the image of a privileged container owns the VM. vBar must also
answer at ``vbar.endpoint`` while it runs (:attr:`Agent.liveness`). The collector binds its
configuration file read-only (:func:`config_file_mount`), the file's digest in the container's
label so an edited file makes a new container at the next start.

Light on purpose: tpuboot/derived.py and doctor read the labels here without the supervisor's metrics,
and the daemon's boot asks which agents are on (:func:`agents_enabled`) without loading the supervision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tpuboot.atomicfile import FileReadError, read_file
from tpuboot.containers.engine import ContainerSpec
from tpuboot.containers.liveness import Liveness

if TYPE_CHECKING:
    from tpuboot.config import Config, TelemetryConfig
    from tpuboot.paths import Root

VBAR = "vBar"
TELEMETRY = "telemetry"
IMAGE_KEY = "VBARCONTROL_AGENT_DOCKER_URL"


class AgentSection(Protocol):
    """What every agent's configuration section has (config.py's ``_PrivilegedImage``)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def image(self) -> str: ...
    @property
    def container_name(self) -> str: ...
    @property
    def registries(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Mounts:
    """An agent's read-only binds, the digest of their content, or why they cannot be made."""

    binds: tuple[tuple[str, str], ...] = ()
    content: str = ""
    problem: str = ""


def no_mounts(config: Config, root: Root) -> Mounts:
    return Mounts()


def no_exec(config: Config) -> tuple[str, ...] | None:
    return None


def no_endpoint(config: Config) -> Liveness | None:
    return None


@dataclass(frozen=True)
class Agent:
    """One supervised agent: where its settings are and how its container is made."""

    #: Its name in STATUS, the journal's AGENT= field and the metrics' label ("vBar").
    label: str
    #: Its configuration section's name ("vbar"): ``vbar.enabled``, ``vbar.image`` in messages.
    section: str
    #: Its section of a configuration.
    settings: Callable[[Config], AgentSection]
    #: What messages call it ("vBar", "the telemetry collector").
    called: str
    #: What it is for, in doctor's "GKE runs ..." ("its device plugin"); "" for nothing.
    role: str = ""
    #: A tpu-env key whose value, when set and not empty, is the image instead of the section's.
    image_key: str | None = None
    #: Its binds, from the configuration and the files under the root.
    mounts: Callable[[Config, Root], Mounts] = field(default=no_mounts)
    #: The argv when the configuration runs it as a child process instead (None: a container).
    exec_argv: Callable[[Config], tuple[str, ...] | None] = field(default=no_exec)
    #: Whether GKE runs it itself on its nodes (tpuboot then leaves it to GKE).
    gke_runs: bool = True
    #: The endpoint it must answer at while it runs, as a fresh record (None: not checked).
    liveness: Callable[[Config], Liveness | None] = field(default=no_endpoint)

    def container(self, config: Config, root: Root, tpu_env: Mapping[str, str] | None) -> ContainerSpec:
        """The container wanted now."""
        section = self.settings(config)
        image, origin = section.image, f"{self.section}.image"
        if self.image_key is not None:
            chosen = (tpu_env or {}).get(self.image_key)
            if chosen:
                image, origin = chosen, f"tpu-env's {self.image_key}"
        mounts = self.mounts(config, root)
        return ContainerSpec(
            section.container_name, image, mounts.binds, origin=origin, content=mounts.content,
            problem=mounts.problem,
        )  # fmt: skip

    @property
    def has_endpoint(self) -> bool:
        """Whether it is an agent that answers at an endpoint (its configuration may turn the
        check off)."""
        return self.liveness is not no_endpoint

    def runtime_key(self, config: Config) -> str | None:
        """``SECTION.runtime is exec`` when it runs as a child process, else None."""
        return None if self.exec_argv(config) is None else f"{self.section}.runtime is exec"


def config_file_mount(section: TelemetryConfig, root: Root) -> Mounts:
    """``config_path`` bound read-only at ``config_target`` (default: the same path), its content's
    digest in the container's label. A missing file is a problem, not a bind: the engine would
    create a directory in its place, and the agent would run on its defaults unnoticed."""
    if not section.config_path:
        return Mounts()
    target = section.config_target or section.config_path
    binds = ((section.config_path, target),)
    key = f"{section.name}.config_path"
    try:
        data = read_file(root, section.config_path)
    except FileReadError as exc:
        return Mounts(binds, problem=f"{key}: {exc}")
    if data is None:
        return Mounts(binds, problem=f"{key} {section.config_path}: no such file; create it or unset {key}")
    return Mounts(binds, content=hashlib.sha256(data).hexdigest()[:16])


def _vbar(config: Config) -> AgentSection:
    return config.vbar


def _vbar_exec(config: Config) -> tuple[str, ...] | None:
    return config.vbar.exec_argv if config.vbar.runtime == "exec" else None


def _vbar_liveness(config: Config) -> Liveness | None:
    endpoint = config.vbar.endpoint
    return None if endpoint is None else Liveness(endpoint, config.vbar.restart_unanswered_after or 0.0)


def _telemetry(config: Config) -> AgentSection:
    return config.telemetry


def _telemetry_mounts(config: Config, root: Root) -> Mounts:
    return config_file_mount(config.telemetry, root)


VBAR_AGENT = Agent(
    VBAR, "vbar", _vbar, "vBar", role="its device plugin", image_key=IMAGE_KEY, exec_argv=_vbar_exec,
    liveness=_vbar_liveness,
)  # fmt: skip
TELEMETRY_AGENT = Agent(
    TELEMETRY, "telemetry", _telemetry, "the telemetry collector", mounts=_telemetry_mounts
)

#: Every agent, in the order they start and are reported.
AGENTS: tuple[Agent, ...] = (VBAR_AGENT, TELEMETRY_AGENT)


def agents_enabled(config: Config, agents: Sequence[Agent] = AGENTS) -> list[Agent]:
    """The agents the configuration turns on (here, light: the daemon's boot asks it too)."""
    return [agent for agent in agents if agent.settings(config).enabled]
