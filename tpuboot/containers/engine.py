"""What tpuboot asks of a container engine, in no engine's terms.

:class:`ContainerEngine` is the seam between the supervision policy
(:mod:`tpuboot.containers.runtime`: adopt, recreate, pull, follow) and an engine's API: Docker's
is :class:`tpuboot.containers.docker.DockerEngine`, which translates :class:`ContainerSpec` into
Engine API JSON and dockerd's answers into :class:`Container`. Another engine (podman,
containerd) is another implementation of the protocol, its errors subclasses of the ones here.

Every container tpuboot makes carries :data:`MANAGED_LABEL` (what prepare-image and the purge
select) and :data:`CONFIG_LABEL` (a digest of what it was made from: a change makes a new one).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tpuboot.errors import TpubootError

MANAGED_LABEL = "io.tpuboot.managed"
CONFIG_LABEL = "io.tpuboot.config"


class EngineError(TpubootError):
    """Anything an engine's client raises; the message is one line."""


class EngineUnreachable(EngineError):
    """The engine is not there (no socket, refused, dropped, timed out): wait for it, no backoff."""


class EngineProtocolError(EngineUnreachable):
    """The engine's answer broke its own protocol: treated as not there (reconnect later)."""


class EngineNotFound(EngineError):
    """No such container or image."""


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials for one pull from ``registry`` (host[:port]); the password is never shown."""

    username: str
    password: str = field(repr=False)
    registry: str


@dataclass(frozen=True)
class ContainerSpec:
    """What the container must be: privileged, host network, these read-only binds."""

    name: str
    image: str
    binds: tuple[tuple[str, str], ...] = field(default=())  # (host path, container path), read-only
    #: Where the image was set, for a message about it ("tpu-env's VBARCONTROL_AGENT_DOCKER_URL").
    origin: str = field(default="", compare=False)
    #: A digest of the bound files' content: a file bound by itself stays the old inode in the
    #: container when it is replaced, so a new content must make a new container.
    content: str = ""
    #: Why this container cannot be started now (a bound file missing): ``start`` says so.
    problem: str = ""

    @property
    def config_hash(self) -> str:
        data: dict[str, Any] = {
            "image": self.image,
            "privileged": True,
            "network": "host",
            "binds": list(self.binds),
        }
        if self.content:  # absent otherwise, so a container made before this field is still adopted
            data["content"] = self.content
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def labels(self) -> dict[str, str]:
        return {MANAGED_LABEL: "1", CONFIG_LABEL: self.config_hash}

    def matches(self, found: Container) -> bool:
        """Whether an existing container is this one (image, privileges, network, the digest)."""
        return (
            found.image == self.image
            and found.privileged
            and found.host_network
            and found.labels.get(CONFIG_LABEL) == self.config_hash
        )


@dataclass(frozen=True)
class Container:
    """An existing container as its engine reports it."""

    ident: str
    names: tuple[str, ...] = ()
    image: str = ""
    running: bool = False
    #: How it stands in the engine's words ("running", "restarting", "exited", "created"...; "" if
    #: the engine does not say).
    status: str = ""
    #: Its exit code once it ended ("?" when the engine does not say).
    exit_code: str = "?"
    privileged: bool = False
    host_network: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)


class ExitStream(Protocol):
    """The exits of one container as they happen; :meth:`close` from any thread ends the iteration."""

    def __iter__(self) -> Iterator[str]:
        """Each exit code; ends without an error when the engine ends the stream or goes away."""
        ...

    def close(self) -> None: ...


class ContainerEngine(Protocol):
    """The calls supervision, prepare-image and doctor make; errors are :class:`EngineError`s."""

    def connect(self) -> None:
        """Reach the engine now (Docker: negotiate its API version); :class:`EngineUnreachable`
        when it is not there."""
        ...

    def inspect(self, name: str) -> Container:
        """The container by name or id; :class:`EngineNotFound` if there is none."""
        ...

    def create(self, spec: ContainerSpec) -> str:
        """Create the container ``spec`` describes, with its labels; its id."""
        ...

    def start(self, ident: str) -> None:
        """Start it; one already running is fine."""
        ...

    def remove(self, ident: str) -> None:
        """Remove it, running or not; :class:`EngineNotFound` if it is gone."""
        ...

    def kill(self, ident: str) -> None:
        """End its process now (SIGKILL): the exit follows on :meth:`exits`; one not running is fine."""
        ...

    def has_image(self, image: str) -> bool: ...

    def pull(self, image: str, auth: RegistryAuth | None) -> None:
        """Pull ``image`` to the end, with ``auth`` for its registry (None: anonymously)."""
        ...

    def exits(self, ident: str) -> ExitStream:
        """Follow the container's exits from now on (no timeout)."""
        ...

    def list_managed(self) -> list[Container]:
        """Every container labelled :data:`MANAGED_LABEL`, running or not."""
        ...
