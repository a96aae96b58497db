"""The daemon's agents component: the vBar control agent and the AI telemetry collector.

Each enabled agent gets a :class:`~tpuboot.supervisor.Supervisor` in its own thread, unless
this VM is a GKE node (GKE runs both itself). Nothing here blocks the daemon's loop or READY:
the GKE check and dockerd's arrival are waited for in threads, and status lines come back
through ``notify(label, text)``, which the daemon hands to its loop.

vBar's image is tpu-env's ``VBARCONTROL_AGENT_DOCKER_URL`` when set and not empty, else
``vbar.image``; it is read from the tpu-env file at each start, so a tpu-env change (the
daemon calls ``reconfigure``) recreates the container with the new image.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from tpuboot.backoff import RestartPolicy
from tpuboot.config import Config
from tpuboot.containers import DOCKER_SOCKET, ContainerSpec, DockerRuntime
from tpuboot.dockerapi import DockerAPI
from tpuboot.gke import Metadata, gke_node
from tpuboot.paths import Root
from tpuboot.supervisor import Runtime, Supervisor
from tpuboot.tpuenv import parse_env_file

log = logging.getLogger("tpuboot.agents")

VBAR = "vBar"
TELEMETRY = "telemetry"
IMAGE_KEY = "VBARCONTROL_AGENT_DOCKER_URL"


def vbar_image(config: Config, root: Root) -> str:
    try:
        text = root.path(config.env.tpu_env_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return config.vbar.image
    return (parse_env_file(text) or {}).get(IMAGE_KEY) or config.vbar.image


class Agents:
    def __init__(
        self,
        config: Config,
        root: Root,
        metadata: Metadata | None,
        docker_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.root = root
        self.metadata = metadata
        self.docker_factory = docker_factory or functools.partial(DockerAPI, str(root.path(DOCKER_SOCKET)))
        self.statuses: dict[str, str] = {}
        self.supervisors: dict[str, Supervisor] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
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
        with self._lock:
            if self.stopping.is_set():
                return
            for label in self.statuses:
                runtime = self._runtime(label)
                policy = RestartPolicy.from_config(self.config.supervisor)
                supervisor = Supervisor(label, runtime, policy, functools.partial(notify, label))
                self.supervisors[label] = supervisor
                supervisor.start()

    def _runtime(self, label: str) -> Runtime:
        config = self.config
        retries = config.supervisor.pull_retries
        if label == VBAR:
            if config.vbar.runtime == "exec":
                from tpuboot.children import ExecRuntime

                return ExecRuntime(config.vbar.exec_argv)

            def vbar_spec() -> ContainerSpec:
                return ContainerSpec(config.vbar.container_name, vbar_image(config, self.root))

            return DockerRuntime(vbar_spec, retries, self.docker_factory)
        telemetry = config.telemetry
        binds = ((telemetry.config_path, telemetry.config_path),) if telemetry.config_path else ()
        spec = ContainerSpec(telemetry.container_name, telemetry.image, binds)
        return DockerRuntime(lambda: spec, retries, self.docker_factory)
