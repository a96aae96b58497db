"""Which processes are tpuboot's own agents' (vBar, the telemetry collector), which `who` names
and ``release --kill`` and ``reset --kill`` never end.

An agent under the exec runtime is told by its program; one in a container by the container:
every container tpuboot made carries :data:`~tpuboot.containers.engine.MANAGED_LABEL`, so the
host's engine lists them all, whatever their names. The engine is asked only about a process in
one of its containers, and once: `who` on a host whose chips nobody holds from a container never
waits for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tpuboot.config import Config
from tpuboot.containers.agents import AGENTS, Agent
from tpuboot.containers.engine import EngineError
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.errors import printable
from tpuboot.holders.procfs import Process
from tpuboot.paths import Root

#: Seconds the engine has to list tpuboot's containers.
ENGINE_TIMEOUT = 5.0

#: The containers tpuboot made, by id, with their names.
Listing = Callable[[], Mapping[str, str]]


class Supervised:
    """Tells tpuboot's agents' processes from the others."""

    def __init__(self, programs: Mapping[str, str] | None = None, containers: Listing | None = None) -> None:
        """``programs``: each exec-runtime agent's program and what messages call the agent;
        ``containers``: lists the engine's containers that tpuboot made (None: no agent runs in one),
        raising :class:`EngineError` when the engine cannot say."""
        self.programs = dict(programs or {})
        self._list = containers
        self._found: Mapping[str, str] | str | None = None

    def reason(self, p: Process) -> str | None:
        """Why ``p`` is left alone as an agent's (or as possibly one's), as a phrase to print (what
        the engine or the configuration named, escaped); None if it is not."""
        program = p.command.split(" ", 1)[0]
        if program in self.programs:
            return f"{self.programs[program]} ({printable(program)}, the exec runtime)"
        if not p.container or p.engine != HOST_ENGINE.kind or self._list is None:
            return None
        found = self._containers()
        if isinstance(found, str):
            return f"in a {p.engine} container, and {printable(found)}"
        for ident, name in found.items():
            if ident.startswith(p.container):
                return f"tpuboot's container {printable(name)} ({printable(ident[:12])})"
        return None

    def _containers(self) -> Mapping[str, str] | str:
        if self._found is None:
            assert self._list is not None
            try:
                self._found = self._list()
            except EngineError as exc:
                self._found = f"{HOST_ENGINE.name} does not say which containers are tpuboot's ({exc})"
        return self._found


def _in_container(agent: Agent, config: Config) -> bool:
    return agent.settings(config).enabled and agent.exec_argv(config) is None


def supervised(root: Root, config: Config) -> Supervised:
    """The agents ``config`` runs, told as :class:`Supervised` does."""
    programs = {}
    for agent in AGENTS:
        argv = agent.exec_argv(config) if agent.settings(config).enabled else None
        if argv:
            programs[argv[0]] = agent.called
    if not any(_in_container(agent, config) for agent in AGENTS):
        return Supervised(programs)

    def managed() -> Mapping[str, str]:
        if not HOST_ENGINE.listening(root):
            return {}  # no engine running: no container of it either
        found = HOST_ENGINE.open(root, timeout=ENGINE_TIMEOUT).list_managed()
        return {c.ident: ",".join(c.names) or c.ident[:12] for c in found if c.ident}

    return Supervised(programs, managed)
