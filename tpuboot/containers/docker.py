"""Docker as a :class:`~tpuboot.containers.engine.ContainerEngine`: the engine-neutral spec as
Engine API JSON, dockerd's answers as :class:`~tpuboot.containers.engine.Container`.

Talks to dockerd over its local socket with :mod:`tpuboot.containers.dockerapi` (the standard
library; no docker SDK, no docker CLI). Supervision over it is
:class:`~tpuboot.containers.docker_runtime.DockerRuntime`; doctor asks it without that.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tpuboot.containers.dockerapi import DockerAPI
from tpuboot.containers.dockerwire import EventStream, NotFound
from tpuboot.containers.engine import MANAGED_LABEL, Container, ContainerSpec, RegistryAuth


def create_config(spec: ContainerSpec) -> dict[str, Any]:
    """The Engine API body of ``POST /containers/create`` for ``spec``."""
    host_config: dict[str, Any] = {"Privileged": True, "NetworkMode": "host"}
    if spec.binds:
        host_config["Binds"] = [f"{host}:{inside}:ro" for host, inside in spec.binds]
    return {"Image": spec.image, "Labels": spec.labels, "HostConfig": host_config}


def container_of(attrs: dict[str, Any]) -> Container:
    """``docker inspect`` (or ``docker ps``) data as the engine-neutral record."""
    config = attrs.get("Config") or {}
    host = attrs.get("HostConfig") or {}
    state = attrs.get("State") or {}
    labels = config.get("Labels") or attrs.get("Labels") or {}
    names = tuple(str(n).lstrip("/") for n in attrs.get("Names") or [attrs.get("Name") or ""] if n)
    return Container(
        ident=str(attrs.get("Id", "")),
        names=names,
        image=str(config.get("Image") or ""),
        running=bool(state.get("Running")) if isinstance(state, dict) else False,
        status=_status(state) if isinstance(state, dict) else "",
        exit_code=str(state.get("ExitCode", "?")) if isinstance(state, dict) else "?",
        privileged=host.get("Privileged") is True,
        host_network=host.get("NetworkMode") == "host",
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
    )


def _status(state: dict[str, Any]) -> str:
    """dockerd's State.Status, with a restart in progress said as such (older dockerd lack Status)."""
    if state.get("Restarting"):
        return "restarting"
    if state.get("Running"):
        return "running"
    return str(state.get("Status") or "")


def split_image(image: str) -> tuple[str, str]:
    """``(repository, tag or digest)`` for a pull; ``latest`` when the name has neither.

    A colon after the last slash starts the tag, so a registry port (``host:5000/img``) stays in
    the repository. A digest (``@sha256:...``) wins over a tag, which is dropped (dockerd does
    the same with both).
    """
    name, at, digest = image.partition("@")
    repository, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:
        repository, tag = name, ""
    if at:
        return repository, digest
    return repository, tag or "latest"


class DockerExits:
    """dockerd's ``die`` events of one container as exit codes."""

    def __init__(self, stream: EventStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        for event in self._stream:
            if event.get("Action") == "die" or event.get("status") == "die":  # status: before API 1.52
                yield str(((event.get("Actor") or {}).get("Attributes") or {}).get("exitCode", "?"))

    def close(self) -> None:
        self._stream.close()


class DockerEngine:
    """A :class:`~tpuboot.containers.engine.ContainerEngine` over one :class:`DockerAPI` client."""

    def __init__(self, client: DockerAPI) -> None:
        self.client = client

    def connect(self) -> None:
        self.client.ping()  # learns dockerd's API version; raises here when dockerd is absent

    def inspect(self, name: str) -> Container:
        return container_of(self.client.inspect_container(name))

    def create(self, spec: ContainerSpec) -> str:
        return self.client.create_container(spec.name, create_config(spec))

    def start(self, ident: str) -> None:
        self.client.start_container(ident)

    def remove(self, ident: str) -> None:
        self.client.remove_container(ident, force=True)

    def kill(self, ident: str) -> None:
        self.client.kill_container(ident)

    def has_image(self, image: str) -> bool:
        try:
            self.client.inspect_image(image)
        except NotFound:
            return False
        return True

    def pull(self, image: str, auth: RegistryAuth | None) -> None:
        repository, tag = split_image(image)
        self.client.pull_image(repository, tag, auth)

    def exits(self, ident: str) -> DockerExits:
        return DockerExits(
            self.client.events({"type": ["container"], "container": [ident], "event": ["die"]})
        )

    def list_managed(self) -> list[Container]:
        found = self.client.list_containers({"label": [f"{MANAGED_LABEL}=1"]})
        return [container_of(item) for item in found]
