"""The container engine tpuboot drives on this host, chosen here and nowhere else.

Supervision (:mod:`tpuboot.containers.service`), prepare-image, doctor and ``release --kill``
reach an engine only through :data:`HOST_ENGINE`, in :class:`~tpuboot.containers.engine`'s
terms; only this module and the Docker modules know Docker. A second engine is a second
:class:`HostEngine` here (its client implementing
:class:`~tpuboot.containers.engine.ContainerEngine`) and the choice of :data:`HOST_ENGINE`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpuboot.containers.docker import DockerEngine
from tpuboot.containers.dockerapi import DOCKER_SOCKET, DOCKERD, TIMEOUT, DockerAPI
from tpuboot.containers.engine import ContainerEngine
from tpuboot.paths import Root


@dataclass(frozen=True)
class HostEngine:
    """One engine as a host has it: its daemon, socket, package and unit, and its client."""

    #: Its daemon, as messages name it ("dockerd").
    name: str
    #: Where it listens, inside the root.
    socket: str
    #: Where its packages put the daemon's binary.
    binaries: tuple[str, ...]
    #: What ``apt install`` gives it, and its systemd unit.
    package: str
    unit: str
    #: Its command line tool ("docker": ``docker logs``, ``docker load``).
    cli: str
    #: How a process's cgroup names its containers (:mod:`tpuboot.holders.procfs`'s engine).
    kind: str
    #: Its client over the socket at this host path, with this timeout per call (seconds).
    client: Callable[[str, float], ContainerEngine]

    def installed(self, root: Root) -> bool:
        """Whether its daemon is there: a socket nobody answers on means "not started" then, and
        "install it" otherwise."""
        return any(root.path(path).exists() for path in self.binaries)

    def listening(self, root: Root) -> bool:
        """Whether its socket is there (an absent socket: no daemon, so no container of it)."""
        return root.path(self.socket).exists()

    def open(self, root: Root, timeout: float = TIMEOUT) -> ContainerEngine:
        """Its client; the engine is reached at the first call."""
        return self.client(str(root.path(self.socket)), timeout)

    def unreachable(self, root: Root) -> str:
        """What STATUS says while the engine does not answer."""
        if not self.installed(root):
            return f"{self.name} is not installed: apt install {self.package}"
        return f"{self.name} not answering on {self.socket}"

    def fix(self, root: Root) -> str:
        """Start it where it is installed, else install it."""
        if self.installed(root):
            return f"systemctl enable --now {self.unit}; journalctl -u {self.unit} says why it stopped"
        return f"apt install {self.package} (then systemctl restart tpuboot)"


def _docker_client(socket_path: str, timeout: float) -> ContainerEngine:
    return DockerEngine(DockerAPI(socket_path, timeout=timeout))


#: Docker's dockerd from Debian's and Ubuntu's docker.io (/usr/sbin) or Docker's docker-ce
#: (/usr/bin): what Google's procedure runs vBar in.
DOCKER = HostEngine(
    name="dockerd",
    socket=DOCKER_SOCKET,
    binaries=DOCKERD,
    package="docker.io",
    unit="docker",
    cli="docker",
    kind="docker",
    client=_docker_client,
)

#: The engine tpuboot supervises its agents in, asks in doctor and prepare-image, and spares in
#: ``release --kill``.
HOST_ENGINE = DOCKER
