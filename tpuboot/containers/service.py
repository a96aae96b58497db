"""The daemon's agents component: the vBar control agent and the AI telemetry collector.

Each enabled agent gets a :class:`~tpuboot.containers.supervisor.Supervisor` in its own thread, unless
this VM is a GKE node (GKE runs both itself), and only once it is known to be a TPU VM: a TPU is
present or tpu-env is held (the daemon calls :meth:`Agents.tpu_vm_seen`). An image-building VM
has neither, so installing the package there runs no privileged container and pulls nothing into
the image. Nothing here blocks the daemon's loop or READY:
the GKE check and dockerd's arrival are waited for in threads, and status lines come back
through ``notify(label, text)``, which the daemon hands to its loop.

vBar's image is tpu-env's ``VBARCONTROL_AGENT_DOCKER_URL`` when set and not empty, else
``vbar.image``. tpu-env is taken from ``tpu_env()``, the values tpuboot itself parsed (in memory
after a sync, else from its root-only cache: :meth:`tpuboot.env.sync.EnvSync.parsed_values`), never
from the tpu-env file: that file's directory may belong to the runtime user, and whoever chooses
the image of a privileged container owns the VM. A tpu-env change (the daemon calls
``reconfigure``) recreates the container with the new image. Each image must also come from a
registry in ``vbar.registries`` / ``telemetry.registries``; another is refused, not run.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tpuboot.atomicfile import FileWriteError, read_file
from tpuboot.backoff import RestartPolicy
from tpuboot.config import Config, TelemetryConfig
from tpuboot.containers.credentials import ServiceAccountCredentials
from tpuboot.containers.docker import ContainerSpec, DockerRuntime
from tpuboot.containers.dockerapi import DOCKER_SOCKET, DockerAPI
from tpuboot.containers.gke import Metadata, gke_node
from tpuboot.containers.imageref import RegistryAllowlist
from tpuboot.containers.supervisor import Runtime, Supervisor
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.containers.service")

VBAR = "vBar"
TELEMETRY = "telemetry"
IMAGE_KEY = "VBARCONTROL_AGENT_DOCKER_URL"


#: Where tpuboot found tpu-env's values: a function returning them, or None when it has none.
TpuEnvSource = Callable[[], "Mapping[str, str] | None"]


def vbar_spec(config: Config, tpu_env: Mapping[str, str] | None) -> ContainerSpec:
    """The vBar container wanted: tpu-env's image when it names one, else the configuration's."""
    image = (tpu_env or {}).get(IMAGE_KEY)
    if image:
        return ContainerSpec(config.vbar.container_name, image, origin=f"tpu-env's {IMAGE_KEY}")
    return ContainerSpec(config.vbar.container_name, config.vbar.image, origin="vbar.image")


#: A collector configuration is a few KiB; this bounds what is read to hash it.
MAX_TELEMETRY_CONFIG = 1 << 20


def telemetry_spec(config: TelemetryConfig, root: Root) -> ContainerSpec:
    """The collector's container: ``config_path`` bound read-only at ``config_target`` (default:
    the same path), its content's digest in the container's label so an edited file makes a new
    container at the next start. A missing file is a problem, not a bind: dockerd would create a
    directory in its place, and the collector would run on its defaults unnoticed."""
    name, image = config.container_name, config.image
    if not config.config_path:
        return ContainerSpec(name, image, origin="telemetry.image")
    target = config.config_target or config.config_path
    binds = ((config.config_path, target),)
    try:
        data = read_file(root, config.config_path, limit=MAX_TELEMETRY_CONFIG)
    except FileWriteError as exc:
        problem = f"telemetry.config_path: {exc}"
    else:
        if data is not None:
            digest = hashlib.sha256(data).hexdigest()[:16]
            return ContainerSpec(name, image, binds, origin="telemetry.image", content=digest)
        problem = (
            f"telemetry.config_path {config.config_path}: no such file; "
            "create it or unset telemetry.config_path"
        )
    return ContainerSpec(name, image, binds, origin="telemetry.image", problem=problem)


def _no_tpu_env() -> Mapping[str, str] | None:
    return None


class Agents:
    def __init__(
        self,
        config: Config,
        root: Root,
        metadata: Metadata | None,
        docker_factory: Callable[[], Any] | None = None,
        tpu_env: TpuEnvSource = _no_tpu_env,
    ) -> None:
        """``tpu_env``: the tpu-env values tpuboot parsed (EnvSync.parsed_values); without it,
        vBar runs ``vbar.image``."""
        self.config = config
        self.root = root
        self.metadata = metadata
        self.tpu_env = tpu_env
        self.docker_factory = docker_factory or functools.partial(DockerAPI, str(root.path(DOCKER_SOCKET)))
        self.statuses: dict[str, str] = {}
        self.supervisors: dict[str, Supervisor] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._credentials: ServiceAccountCredentials | None = None  # one token cache for both agents
        self._tpu_vm = threading.Event()  # a TPU present or tpu-env held: the supervisors may start
        self._gate = threading.Event()  # set by the first of tpu_vm_seen() and stop()
        for label, enabled in ((VBAR, config.vbar.enabled), (TELEMETRY, config.telemetry.enabled)):
            if enabled:
                self.statuses[label] = f"{label}: starting"

    @property
    def status(self) -> str:
        return "; ".join(self.statuses.values())

    def start(self, notify: Callable[[str, str], None]) -> None:
        """Decide (GKE?) and start the supervisors in a thread; ``notify(label, text)`` from any thread."""
        if not self.statuses:
            return
        self._thread = threading.Thread(
            target=self._begin, args=(notify,), name="tpuboot-agents", daemon=True
        )
        self._thread.start()

    @property
    def is_tpu_vm(self) -> bool:
        return self._tpu_vm.is_set()

    def tpu_vm_seen(self, why: str) -> None:
        """This VM is a TPU VM (``why``: a TPU present, tpu-env held); from any thread, once."""
        if self._tpu_vm.is_set():
            return
        self._tpu_vm.set()
        if self.statuses:
            log.info("%s: a TPU VM (%s)", " and ".join(self.statuses), why)
        self._gate.set()

    def set_status(self, label: str, text: str) -> None:
        """On the daemon's loop: record a status line sent with ``notify``."""
        self.statuses[label] = text

    def reconfigure(self) -> None:
        """tpu-env may have changed: each supervisor looks at its wanted container again."""
        with self._lock:
            supervisors = list(self.supervisors.values())
        for supervisor in supervisors:
            supervisor.reconfigure()

    def stop(self) -> None:
        """Stop supervising. Containers keep running; an exec child is ended."""
        self.stopping.set()
        self._gate.set()
        close = getattr(self.metadata, "close", None)
        if close is not None:
            close()  # cuts short a GKE check in flight
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            supervisors = list(self.supervisors.values())
        for supervisor in supervisors:
            supervisor.stop()

    # ------------------------------------------------------------------ in the agents thread

    def _begin(self, notify: Callable[[str, str], None]) -> None:
        gke = gke_node(self.config.gke, self.metadata, self.stopping, self.config.metadata.boot_deadline)
        if gke is None:
            return
        if gke:
            for label in self.statuses:
                what = "vBar" if label == VBAR else "the telemetry collector"
                text = f"{label}: not started, GKE node (GKE runs {'it' if label == VBAR else what})"
                log.info("%s", text, extra={"AGENT": label})
                notify(label, text)
            return
        if not self._tpu_vm.is_set():
            for label in self.statuses:
                text = f"{label}: not started, not a TPU VM (no TPU present, no tpu-env)"
                log.info("%s; starting once either appears", text, extra={"AGENT": label})
                notify(label, text)
            self._gate.wait()
        with self._lock:
            if self.stopping.is_set():
                return
            for label in self.statuses:
                runtime = self._runtime(label)
                policy = RestartPolicy.from_config(self.config.supervisor)
                supervisor = Supervisor(label, runtime, policy, functools.partial(notify, label))
                self.supervisors[label] = supervisor
                supervisor.start()

    def _registry_credentials(self) -> ServiceAccountCredentials:
        """The VM's service-account token for pulls from ``registry_auth.token_registries``."""
        if self._credentials is None:
            from tpuboot.env.metadata import MetadataClient

            if self.metadata is None:  # gke: true/false asks nothing else; stop() closes it
                self.metadata = MetadataClient.from_config(self.config.metadata)
            client: Any = self.metadata
            self._credentials = ServiceAccountCredentials(client, self.config.registry_auth.token_registries)
        return self._credentials

    def _runtime(self, label: str) -> Runtime:
        config = self.config
        retries = config.supervisor.pull_retries
        if label == VBAR:
            if config.vbar.runtime == "exec":
                from tpuboot.containers.exec import ExecRuntime

                return ExecRuntime(config.vbar.exec_argv)

            allowlist = RegistryAllowlist(config.vbar.registries, "vbar.registries")

            def wanted() -> ContainerSpec:
                return vbar_spec(config, self.tpu_env())

            credentials = self._registry_credentials()
            return DockerRuntime(
                wanted, retries, self.docker_factory, allowlist=allowlist, credentials=credentials
            )
        telemetry = config.telemetry
        allowlist = RegistryAllowlist(telemetry.registries, "telemetry.registries")
        return DockerRuntime(
            lambda: telemetry_spec(telemetry, self.root),
            retries,
            self.docker_factory,
            allowlist=allowlist,
            credentials=self._registry_credentials(),
        )
