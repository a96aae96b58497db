"""The docker runtime: an agent as a privileged host-network container, through the Docker Engine API.

Talks to dockerd over its local socket with the docker SDK (Debian's python3-docker 5.0.3 and
later); no docker CLI. The container has a fixed name and tpuboot's labels
(``io.tpuboot.managed=1``, ``io.tpuboot.config=<hash of image and settings>``):

- one already running with the wanted image and settings is adopted (a tpuboot restart does
  not restart the agent); one whose image or settings differ is removed and created again;
- a missing image is pulled, ``pull_retries`` times at most;
- ``wait`` follows Docker's event stream for the container's ``die``; the stream ending
  means dockerd went away.

Closing leaves the container running: it must survive a tpuboot restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpuboot.supervisor import CannotStart, RuntimeUnavailable, Started, StartFailed

log = logging.getLogger("tpuboot.containers")

DOCKER_SOCKET = "/run/docker.sock"
MANAGED_LABEL = "io.tpuboot.managed"
CONFIG_LABEL = "io.tpuboot.config"
PULL_PAUSE_MAX = 8.0


@dataclass(frozen=True)
class ContainerSpec:
    """What the container must be: privileged, host network, these read-only binds."""

    name: str
    image: str
    binds: tuple[tuple[str, str], ...] = field(default=())  # (host path, container path), read-only

    @property
    def config_hash(self) -> str:
        data = {"image": self.image, "privileged": True, "network": "host", "binds": list(self.binds)}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def labels(self) -> dict[str, str]:
        return {MANAGED_LABEL: "1", CONFIG_LABEL: self.config_hash}

    def volumes(self) -> dict[str, dict[str, str]]:
        return {host: {"bind": inside, "mode": "ro"} for host, inside in self.binds}

    def matches(self, attrs: dict[str, Any]) -> bool:
        """Whether an existing container (``docker inspect`` data) is this one."""
        config = attrs.get("Config") or {}
        host = attrs.get("HostConfig") or {}
        labels = config.get("Labels") or {}
        return (
            config.get("Image") == self.image
            and host.get("Privileged") is True
            and host.get("NetworkMode") == "host"
            and labels.get(CONFIG_LABEL) == self.config_hash
        )


def docker_client(socket_path: str = DOCKER_SOCKET) -> Any:
    import docker

    # "auto": the API version dockerd speaks (newer engines refuse old fixed versions). It asks
    # dockerd at once, so an absent dockerd raises here, inside DockerRuntime.start.
    return docker.DockerClient(base_url=f"unix://{socket_path}", version="auto", timeout=60)


def _unreachable(exc: BaseException) -> bool:
    """An error saying dockerd is not there (as opposed to an answer from it)."""
    import docker.errors
    import requests

    if isinstance(exc, docker.errors.APIError):
        return False
    return isinstance(exc, (requests.exceptions.ConnectionError, docker.errors.DockerException, OSError))


def _reason(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def split_image(image: str) -> tuple[str, str]:
    """``(repository, tag or digest)``; ``latest`` when the name has neither."""
    from docker.utils import parse_repository_tag

    repository, tag = parse_repository_tag(image)
    return repository, tag or "latest"


class DockerRuntime:
    def __init__(
        self,
        spec: Callable[[], ContainerSpec],
        pull_retries: int = 5,
        client_factory: Callable[[], Any] = docker_client,
        pause: Callable[[float], object] | None = None,
    ) -> None:
        self.spec = spec
        self.pull_retries = pull_retries
        self.client_factory = client_factory
        self.client: Any = None
        self.container_id: str | None = None
        self._running: ContainerSpec | None = None  # the spec of the container being followed
        self.fields: dict[str, str] = {"CONTAINER": spec().name}
        self._stream: Any = None
        self._interrupted = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pause = pause or self._closed.wait

    # ------------------------------------------------------------------ Runtime

    def start(self) -> Started:
        self._interrupted.clear()
        if self._closed.is_set():
            raise RuntimeUnavailable("stopping")
        spec = self.spec()
        self.fields = {"CONTAINER": spec.name, "IMAGE": spec.image}
        self._running = None
        try:
            started = self._start(spec)
        except (RuntimeUnavailable, CannotStart, StartFailed):
            raise
        except Exception as exc:
            if _unreachable(exc):
                self._drop_client()
                raise RuntimeUnavailable(f"dockerd not answering on {DOCKER_SOCKET}") from None
            raise StartFailed(f"{spec.name}: {_reason(exc)}") from None
        self._running = spec
        return started

    def wait(self) -> str | None:
        client, ident = self.client, self.container_id
        if client is None or ident is None:
            return None
        try:
            stream = client.events(
                decode=True, filters={"type": "container", "container": ident, "event": "die"}
            )
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            self._drop_client()
            raise RuntimeUnavailable(f"dockerd not answering ({_reason(exc)})") from None
        with self._lock:
            self._stream = stream
        try:
            if self._interrupted.is_set():
                return None
            # Subscribed first, then looked: a death before the subscription shows here.
            state = client.containers.get(ident).attrs.get("State") or {}
            if not state.get("Running"):
                return f"exit {state.get('ExitCode', '?')}"
            for event in stream:
                if event.get("status") == "die" or event.get("Action") == "die":
                    code = ((event.get("Actor") or {}).get("Attributes") or {}).get("exitCode", "?")
                    return f"exit {code}"
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            if not _unreachable(exc):
                return f"gone ({_reason(exc)})"  # removed by hand: start again
        finally:
            with self._lock:
                self._stream = None
            self._close_stream(stream)
        if self._interrupted.is_set():
            return None
        self._drop_client()
        raise RuntimeUnavailable("dockerd went away")

    def interrupt(self) -> bool:
        """Only when the wanted container changed: a tpu-env change elsewhere leaves it be."""
        if self._running is not None and not self._closed.is_set():
            try:
                if self.spec() == self._running:
                    return False
            except Exception:  # the spec cannot be read now: look again in start()
                pass
        self._cut()
        return True

    def _cut(self) -> None:
        self._interrupted.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            self._close_stream(stream)

    def close(self) -> None:
        """Stop following the container; the container itself keeps running."""
        self._closed.set()
        self._cut()

    # ------------------------------------------------------------------ helpers

    def _client(self) -> Any:
        if self.client is None:
            self.client = self.client_factory()
            self.client.ping()
        return self.client

    def _drop_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    @staticmethod
    def _close_stream(stream: Any) -> None:
        with contextlib.suppress(Exception):
            stream.close()

    def _start(self, spec: ContainerSpec) -> Started:
        import docker.errors

        client = self._client()
        try:
            container = client.containers.get(spec.name)
        except docker.errors.NotFound:
            container = None
        how = "started"
        if container is not None:
            if spec.matches(container.attrs):
                self.container_id = container.id
                if (container.attrs.get("State") or {}).get("Running"):
                    return Started("adopted", container.id[:12])
                container.start()
                return Started("restarted", container.id[:12])
            log.info(
                "%s: image or settings differ from the configuration; recreating it",
                spec.name,
                extra={"CONTAINER": spec.name, "IMAGE": spec.image},
            )
            container.remove(force=True)
            how = "recreated"
        self._ensure_image(client, spec.image)
        container = client.containers.create(
            spec.image,
            name=spec.name,
            detach=True,
            privileged=True,
            network_mode="host",
            labels=spec.labels,
            volumes=spec.volumes() or None,
        )
        self.container_id = container.id
        container.start()
        return Started(how, container.id[:12])

    def _ensure_image(self, client: Any, image: str) -> None:
        import docker.errors

        try:
            client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            pass
        repository, tag = split_image(image)
        tries = self.pull_retries + 1
        reason = ""
        for attempt in range(tries):
            if self._closed.is_set():
                raise RuntimeUnavailable("stopping")
            try:
                client.images.pull(repository, tag=tag)
                log.info("pulled %s", image, extra={"IMAGE": image})
                return
            except Exception as exc:
                if _unreachable(exc):
                    raise
                reason = _reason(exc)
            if attempt + 1 < tries:
                self._pause(min(PULL_PAUSE_MAX, 2.0**attempt))
                try:  # loaded meanwhile (docker load / import at boot)
                    client.images.get(image)
                    return
                except docker.errors.ImageNotFound:
                    pass
        raise CannotStart(
            f"cannot pull image {image} ({tries} tries: {reason}); "
            "make it reachable, load it with `docker load`, or set another image"
        )
