"""The daemon's supervised agents (:data:`tpuboot.containers.agents.AGENTS`: the vBar control
agent and the AI telemetry collector).

A part of the daemon (tpuboot/component.py). Each enabled agent gets a
:class:`~tpuboot.containers.supervisor.Supervisor` in its own thread, unless this VM is a GKE node
(GKE runs them itself), and only once it is known to be a TPU VM: a TPU is present or tpu-env is
held (tpuboot/derived.py's gate calls :meth:`Containers.tpu_vm_seen`). An image-building VM has neither, so
installing the package there runs no privileged container and pulls nothing into the image.
Nothing here blocks the daemon's loop or READY: the GKE check and the engine's arrival are waited
for in threads; each agent's Status is kept here under a lock and ``report()`` says it changed.

What each agent's container is comes from its :class:`~tpuboot.containers.agents.Agent`; tpu-env
is taken from ``tpu_env()``, the values tpuboot itself parsed (in memory after a sync, else from
its root-only cache: :meth:`tpuboot.env.sync.EnvSync.parsed_values`), never from the tpu-env file.
A tpu-env change (the runtime-environment side calls ``reconfigure`` from its thread: it reads
files, never on the loop) recreates a container whose image it chose. Each image must also come
from a registry in its section's ``registries``; another is refused, not run.

An agent with an endpoint (vBar's ``vbar.endpoint``) is probed at each of the daemon's ticks while
it runs (:meth:`Containers.check_endpoints`, in the daemon's pool): STATUS, the journal and
``tpuboot_container_endpoint_up`` say when it stops answering, and its container is restarted once
it has not answered for ``vbar.restart_unanswered_after`` (unset: never).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Literal

from tpuboot import metrics
from tpuboot.backoff import RestartPolicy
from tpuboot.component import Part, Report, Status
from tpuboot.config import Config
from tpuboot.containers.agents import AGENTS, Agent, agents_enabled
from tpuboot.containers.credentials import ServiceAccountCredentials, TokenSource
from tpuboot.containers.engine import ContainerEngine, ContainerSpec
from tpuboot.containers.exec import ExecRuntime
from tpuboot.containers.gke import gke_node
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.liveness import Liveness, probe
from tpuboot.containers.runtime import runtime_on
from tpuboot.containers.supervisor import RUNNING, STARTING, Runtime, SupervisedState, Supervisor
from tpuboot.eventloop import nothing
from tpuboot.paths import Root
from tpuboot.references import RegistryAllowlist

if TYPE_CHECKING:
    from tpuboot.devices.snapshot import DeviceSnapshot

log = logging.getLogger("tpuboot.containers.service")

#: Where tpuboot found tpu-env's values: a function returning them, or None when it has none.
TpuEnvSource = Callable[[], "Mapping[str, str] | None"]


def _no_tpu_env() -> Mapping[str, str] | None:
    return None


#: An agent's state (Status.state): its supervisor's, or ``not started``: before its supervisor
#: starts, when it never will (GKE) or not yet (no TPU VM).
ContainerState = Literal[SupervisedState, "not started"]
NOT_STARTED: Final[ContainerState] = "not started"


class Containers(Part):
    """The enabled agents as a part of the daemon; ``status()`` joins theirs (state ``running`` when
    every one runs), its tick probes their endpoints. It stops after the daemon closes the metadata
    client, which cuts a GKE check or a registry token's fetch its threads may wait in."""

    name = "containers"
    stops_after_metadata = True

    def __init__(
        self,
        config: Config,
        root: Root,
        metadata: TokenSource | None,
        engine: Callable[[], ContainerEngine] | None = None,
        tpu_env: TpuEnvSource = _no_tpu_env,
        agents: Sequence[Agent] = AGENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``metadata``: for the GKE check (``gke: auto``) and the registry token; shared: the daemon
        closes it.
        ``tpu_env``: the tpu-env values tpuboot parsed (EnvSync.parsed_values); without it, vBar
        runs ``vbar.image``. ``agents``: the agents to supervise (those enabled). ``engine``: how to
        reach the host's engine (tests; default: :data:`~tpuboot.containers.hostengine.HOST_ENGINE`'s
        socket under the root)."""
        self.config = config
        self.root = root
        self.metadata = metadata
        self.tpu_env = tpu_env
        self.engine = engine
        self.supervisors: dict[str, Supervisor] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # guards _statuses and supervisors
        self._statuses: dict[str, Status] = {}
        self._report: Report = nothing
        self._thread: threading.Thread | None = None
        self._credentials: ServiceAccountCredentials | None = None  # one token cache for every agent
        self._tpu_vm = threading.Event()  # a TPU present or tpu-env held: the supervisors may start
        self._gate = threading.Event()  # set by the first of tpu_vm_seen() and stop()
        self.agents = {agent.label: agent for agent in agents_enabled(config, agents)}
        for label in self.agents:
            self._statuses[label] = Status(STARTING, "starting")
        self.clock = clock
        self._liveness: dict[str, Liveness] = {}  # under _lock; by label, for agents with an endpoint
        for label, agent in self.agents.items():
            liveness = agent.liveness(config)
            if liveness is not None:
                self._liveness[label] = liveness

    @property
    def enabled(self) -> bool:
        return bool(self._statuses)

    @property
    def checks_endpoints(self) -> bool:
        """Whether an agent has an endpoint to probe (the daemon ticks for it)."""
        return bool(self._liveness)

    @property
    def periodic(self) -> bool:
        return self.checks_endpoints

    def tick(self, devices: DeviceSnapshot) -> None:
        self.check_endpoints()

    def statuses(self) -> dict[str, Status]:
        """Each enabled agent's Status, by label (vBar, telemetry), with what its endpoint's last
        check said while it runs; from any thread."""
        with self._lock:
            shown = dict(self._statuses)
            for label, liveness in self._liveness.items():
                status = shown[label]
                if status.state == RUNNING and liveness.detail():
                    shown[label] = Status(RUNNING, status.detail + liveness.detail())
            return shown

    def status(self) -> Status:
        statuses = self.statuses()
        up = all(s.state == RUNNING for s in statuses.values())
        detail = "; ".join(f"{label}: {s.detail}" for label, s in statuses.items())
        return Status(RUNNING if up else STARTING, detail)

    def start(self, report: Report) -> None:
        """Decide (GKE?) and start the supervisors in a thread of its own."""
        if not self._statuses:
            return
        self._report = report
        self._thread = threading.Thread(target=self._begin, name="tpuboot-containers", daemon=True)
        self._thread.start()

    def tpu_vm_seen(self, why: str) -> None:
        """This VM is a TPU VM (``why``: a TPU present, tpu-env held); from any thread, once."""
        if self._tpu_vm.is_set():
            return
        self._tpu_vm.set()
        if self._statuses:
            log.info("%s: a TPU VM (%s)", " and ".join(self._statuses), why)
        self._gate.set()

    def reconfigure(self) -> None:
        """tpu-env may have changed: each supervisor looks at its wanted container again. Not on
        the daemon's loop: a runtime reads the files its container binds."""
        with self._lock:
            supervisors = list(self.supervisors.values())
        for supervisor in supervisors:
            supervisor.reconfigure()

    def stop(self) -> None:
        """Stop supervising. Containers keep running; an exec child is ended. A GKE check in flight
        ends when the daemon closes the metadata client."""
        self.stopping.set()
        self._gate.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            supervisors = list(self.supervisors.values())
        for supervisor in supervisors:
            supervisor.stop()

    # ------------------------------------------------------------------ in its own threads

    def _set(self, label: str, status: Status) -> None:
        """A container's new Status (from this part's thread or its supervisor's). Whatever it
        is (started, restarted, ended), the container running now is judged afresh."""
        with self._lock:
            self._statuses[label] = status
            liveness = self._liveness.get(label)
            if liveness is not None:
                liveness.forget()
        if liveness is not None:
            metrics.container_endpoint_up(label, None)
        self._report()

    def check_endpoints(self) -> None:
        """Probe each running agent's endpoint once (the daemon's tick, from its pool: a connect may
        wait up to CONNECT_TIMEOUT). A change of answer is logged and reported; an agent unanswered
        past its restart_after has its container ended, for its supervisor to restart."""
        with self._lock:
            running = {
                label: (liveness, self.supervisors.get(label))
                for label, liveness in self._liveness.items()
                if self._statuses[label].state == RUNNING
            }
        for label, (liveness, supervisor) in running.items():
            if supervisor is None:
                continue
            problem = probe(liveness.endpoint, self.root)
            with self._lock:
                if self._statuses[label].state != RUNNING:
                    continue  # ended while probed: its successor is judged afresh
                before = liveness.answering
                due = liveness.observe(problem, self.clock())
                since = liveness.failing_since
            metrics.container_endpoint_up(label, problem is None)
            fields = {"AGENT": label, "ENDPOINT": str(liveness.endpoint)}
            if before is not (problem is None):
                if problem is None:
                    log.info("%s: answering at %s", label, liveness.endpoint, extra=fields)
                else:
                    what = f"not answering at {liveness.endpoint}: {problem}"
                    log.warning("%s: %s", label, what, extra=fields)
                self._report()
            if due and since is not None:
                unanswered = self.clock() - since
                supervisor.restart(f"not answering at {liveness.endpoint} for {unanswered:.0f} s ({problem})")

    def _begin(self) -> None:
        labels = list(self._statuses)

        def asking(why: str) -> None:
            for label in labels:
                self._set(label, Status(NOT_STARTED, f"not started, asking whether this is a GKE node{why}"))

        if self.config.gke == "auto":
            asking("")
        deadline = self.config.metadata.boot_deadline
        gke = gke_node(
            self.config.gke, self.metadata, self.stopping, deadline, lambda why: asking(f" ({why})")
        )
        if gke is None:
            return
        if gke:
            for label in labels:
                agent = self.agents[label]
                if not agent.gke_runs:
                    continue
                what = "it" if agent.called == label else agent.called  # "vBar: ... GKE runs it"
                detail = f"not started, GKE node (GKE runs {what})"
                log.info("%s: %s", label, detail, extra={"AGENT": label})
                self._set(label, Status(NOT_STARTED, detail))
            labels = [label for label in labels if not self.agents[label].gke_runs]
            if not labels:
                return
        if not self._tpu_vm.is_set():
            for label in labels:
                detail = "not started, not a TPU VM (no TPU present, no tpu-env)"
                log.info("%s: %s; starting once either appears", label, detail, extra={"AGENT": label})
                self._set(label, Status(NOT_STARTED, detail))
            self._gate.wait()
        with self._lock:
            if self.stopping.is_set():
                return
            for label in labels:
                runtime = self._runtime(self.agents[label])
                policy = RestartPolicy.from_config(self.config.supervisor)
                supervisor = Supervisor(label, runtime, policy, self._set)
                self.supervisors[label] = supervisor
                supervisor.start()

    def _registry_credentials(self) -> ServiceAccountCredentials | None:
        """The VM's service-account token for pulls from ``registry_auth.token_registries``: one
        token cache for every agent, through the daemon's metadata client; none without one."""
        if self._credentials is None and self.metadata is not None:
            registries = self.config.registry_auth.token_registries
            self._credentials = ServiceAccountCredentials(self.metadata, registries)
        return self._credentials

    def _runtime(self, agent: Agent) -> Runtime:
        config = self.config
        argv = agent.exec_argv(config)
        if argv is not None:
            return ExecRuntime(argv)
        section = agent.settings(config)

        def wanted() -> ContainerSpec:
            return agent.container(config, self.root, self.tpu_env())

        return runtime_on(
            HOST_ENGINE,
            self.root,
            wanted,
            allowlist=RegistryAllowlist(section.registries, f"{agent.section}.registries"),
            pull_retries=config.supervisor.pull_retries,
            credentials=self._registry_credentials(),
            client=self.engine,
        )
