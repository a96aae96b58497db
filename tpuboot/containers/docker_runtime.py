"""The supervision policy (:mod:`tpuboot.containers.runtime`) over dockerd
(:class:`~tpuboot.containers.docker.DockerEngine`), with dockerd's own words for "not there"."""

from __future__ import annotations

from collections.abc import Callable

from tpuboot.containers.credentials import ServiceAccountCredentials
from tpuboot.containers.docker import ENGINE_NAME, DockerEngine
from tpuboot.containers.dockerapi import DOCKER_SOCKET, DockerAPI
from tpuboot.containers.engine import ContainerSpec
from tpuboot.containers.runtime import EngineRuntime
from tpuboot.references import RegistryAllowlist


class DockerRuntime(EngineRuntime):
    """The supervision policy over dockerd: what STATUS says while dockerd does not answer."""

    def __init__(
        self,
        spec: Callable[[], ContainerSpec],
        pull_retries: int = 5,
        client_factory: Callable[[], DockerAPI] = DockerAPI,  # connects at its first call (ping)
        pause: Callable[[float], object] | None = None,
        *,
        allowlist: RegistryAllowlist,
        credentials: ServiceAccountCredentials | None = None,
        installed: Callable[[], bool] | None = None,
    ) -> None:
        """``installed``: whether dockerd is installed at all (dockerapi.dockerd_installed), asked
        when its socket does not answer so that STATUS says what the agent waits for."""
        self.installed = installed
        super().__init__(
            spec,
            lambda: DockerEngine(client_factory()),
            allowlist=allowlist,
            unreachable=self._unreachable_reason,
            pull_retries=pull_retries,
            pause=pause,
            credentials=credentials,
            engine_name=ENGINE_NAME,
            load_hint="load it with `docker load`",
        )

    def _unreachable_reason(self) -> str:
        if self.installed is not None and not self.installed():
            return "dockerd is not installed: apt install docker.io"
        return f"dockerd not answering on {DOCKER_SOCKET}"
