"""Doctor's checks of the supervised agents: one ``SECTION-running`` check per agent of
:data:`tpuboot.containers.agents.AGENTS` (``vbar-running``, ``telemetry-running``), and a
``SECTION-endpoint`` check for an agent that must answer at an endpoint (``vbar-endpoint``: it
accepts a connection at ``vbar.endpoint``, as the daemon checks at each tick).

Each one is SKIP when the agent is off, when GKE runs it (:mod:`tpuboot.containers.gke`, the
daemon's rule, asked once) or when it runs as a child process; otherwise the engine must answer and
the agent's container exist and run. The engine is asked through a :data:`ContainerProbe` a test
replaces (the host engine's: :func:`engine_container_state`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

from tpuboot.config import Config
from tpuboot.containers.agents import AGENTS, Agent
from tpuboot.containers.engine import ContainerEngine, EngineError, EngineNotFound, EngineUnreachable
from tpuboot.containers.gke import GkeAnswer, Metadata, ask_gke
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.liveness import EndpointProbe, probe
from tpuboot.errors import MetadataError
from tpuboot.numbers import ascii_signed
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, failed, passed, skipped

RUNNING, ABSENT = "running", "absent"
#: What a check that needs the metadata server says when it did not answer: the reason is said once,
#: by doctor's metadata-server check.
UNANSWERED = "no answer from the metadata server, see the metadata-server check"

#: ``state(root, name)``: "running", "absent", or how the container stands ("exited (code 1)");
#: raises :class:`EngineUnreachable` when the engine does not answer, another EngineError when it
#: answers unusably.
ContainerProbe = Callable[[Root, str], str]


class DeadlineMetadata(Metadata, Protocol):
    """Doctor's metadata server (its ``AskedOnce``): answers within ``deadline_s``; ``down`` once it
    did not (doctor's metadata-server check says why)."""

    deadline_s: float
    down: MetadataError | None


def container_state(engine: ContainerEngine, name: str) -> str:
    """How container ``name`` stands, asked of ``engine`` (see :data:`ContainerProbe`)."""
    try:
        container = engine.inspect(name)
    except EngineNotFound:
        return ABSENT
    if container.status == "restarting":
        return "restarting"
    if container.running:
        return RUNNING
    status = container.status or "stopped"
    if status == "exited" and ascii_signed(container.exit_code) is not None:
        return f"exited (exit code {container.exit_code})"
    return status


def engine_container_state(root: Root, name: str) -> str:
    """:func:`container_state` asked of the host's engine over its socket (the daemon's
    :data:`ContainerProbe`)."""
    if not HOST_ENGINE.listening(root):
        raise EngineUnreachable(f"no socket {HOST_ENGINE.socket}")
    return container_state(HOST_ENGINE.open(root, timeout=5), name)


def running(agent: Agent) -> Criterion:
    """What ``SECTION-running`` holds a host to, for ``agent``."""
    unless = "it is off or GKE runs it" if agent.gke_runs else "it is off"
    return Criterion(f"{agent.section}-running", f"{agent.called} running in its container, unless {unless}")


def answering(agent: Agent) -> Criterion:
    """What ``SECTION-endpoint`` holds a host to, for an agent with an endpoint."""
    return Criterion(
        f"{agent.section}-endpoint",
        f"{agent.called} accepting connections at {agent.section}.endpoint while it runs",
    )


class ContainerChecks:
    """The agents' checks for one system, named for :class:`tpuboot.verdicts.Checks`."""

    def __init__(
        self,
        root: Root,
        config: Config,
        metadata: DeadlineMetadata,
        container_state: ContainerProbe = engine_container_state,
        agents: Sequence[Agent] = AGENTS,
        endpoint_probe: EndpointProbe = probe,
    ) -> None:
        self.root = root
        self.endpoint_probe = endpoint_probe
        self.config = config
        self.metadata = metadata
        self.container_state = container_state
        self.agents = tuple(agents)
        self._gke_answer: GkeAnswer | None = None

    def named(self) -> list[tuple[Criterion, Callable[[], CheckResult]]]:
        """The checks, in run order, for the doctor's table."""
        named: list[tuple[Criterion, Callable[[], CheckResult]]]
        named = [(running(agent), functools.partial(self.check, agent)) for agent in self.agents]
        named += [
            (answering(agent), functools.partial(self.check_endpoint, agent))
            for agent in self.agents
            if agent.has_endpoint
        ]
        return named

    def _gke(self) -> GkeAnswer:
        """The daemon's answer to "a GKE node?", asked once, within doctor's deadline."""
        if self._gke_answer is None:
            self._gke_answer = ask_gke(self.config.gke, self.metadata, self.metadata.deadline_s)
        return self._gke_answer

    def _not_run_here(self, agent: Agent) -> CheckResult | None:
        """SKIP when tpuboot does not run the agent on this host (off, or GKE runs it), else None."""
        if not agent.settings(self.config).enabled:
            return skipped(f"{agent.section}.enabled is false in the configuration")
        if agent.gke_runs:
            gke = self._gke()
            what = f"{agent.called} ({agent.role})" if agent.role else agent.called
            if gke.node:
                return skipped(f"a GKE node ({gke.why}): GKE runs {what}")
            if gke.node is None:
                why = UNANSWERED if self.metadata.down is not None else gke.why
                return skipped(f"cannot tell whether this is a GKE node: {why}; set gke: true or false")
        return None

    def check(self, agent: Agent) -> CheckResult:
        """SKIP when tpuboot does not run it here; else its container exists and runs."""
        skip = self._not_run_here(agent)
        if skip is not None:
            return skip
        runtime = agent.runtime_key(self.config)
        if runtime is not None:
            return skipped(f"{runtime}: no container to ask about")
        return self._container(agent)

    def check_endpoint(self, agent: Agent) -> CheckResult:
        """While the agent runs, its endpoint accepts a connection (libtpu's way to it)."""
        skip = self._not_run_here(agent)
        if skip is not None:
            return skip
        liveness = agent.liveness(self.config)
        if liveness is None:
            return skipped(f"{agent.section}.endpoint is empty: not checked")
        name = agent.settings(self.config).container_name
        logs = f"{HOST_ENGINE.cli} logs {name}"
        if agent.runtime_key(self.config) is not None:
            logs = f"journalctl -u tpuboot AGENT={agent.label}"
        else:  # a container: only a running one must answer
            try:
                state = self.container_state(self.root, name)
            except EngineError as exc:
                return skipped(f"cannot ask {HOST_ENGINE.name} ({exc}); {running(agent).name} says more")
            if state != RUNNING:
                return skipped(f"container {name} is {state}: {running(agent).name} says why")
        problem = self.endpoint_probe(liveness.endpoint, self.root)
        if problem is None:
            return passed(f"{agent.called} accepts connections at {liveness.endpoint}")
        return failed(
            f"{agent.called} runs but does not answer at {liveness.endpoint} ({problem})",
            f"{logs} says why; if it listens elsewhere, set {agent.section}.endpoint to where the "
            f"jobs reach it; {agent.section}.restart_unanswered_after restarts it when this lasts",
        )

    def _container(self, agent: Agent) -> CheckResult:
        """The engine answers, and the agent's container exists and runs."""
        name = agent.settings(self.config).container_name
        fix = (
            f"systemctl restart tpuboot (it supervises {agent.called}); "
            f"journalctl -u tpuboot AGENT={agent.label} says why it stopped"
        )
        try:
            state = self.container_state(self.root, name)
        except EngineUnreachable as exc:
            return failed(
                f"{HOST_ENGINE.name} does not answer ({exc}): {agent.called} cannot run",
                HOST_ENGINE.fix(self.root),
            )
        except EngineError as exc:  # the engine answered, unusably: its message says what to upgrade
            return failed(
                f"{HOST_ENGINE.name}: {exc}",
                f"do what {HOST_ENGINE.name}'s answer says; journalctl -u {HOST_ENGINE.unit} has more",
            )
        if state == RUNNING:
            return passed(f"container {name} is running")
        if state == ABSENT:
            return failed(f"container {name} does not exist", fix)
        return failed(f"container {name} is {state}", fix)
