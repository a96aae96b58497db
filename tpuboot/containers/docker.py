"""The docker runtime: vBar or the collector as a privileged host-network container (Docker Engine API).

Talks to dockerd over its local socket with :mod:`tpuboot.containers.dockerapi` (the standard library; no
docker SDK, no docker CLI). The container has a fixed name and tpuboot's labels
(``io.tpuboot.managed=1``, ``io.tpuboot.config=<hash of image and settings>``):

- the image must come from a registry in its allowlist (:mod:`tpuboot.containers.imageref`):
  otherwise nothing is pulled, created, adopted or started, and ``start`` raises Refused;
- one already running with the wanted image and settings is adopted (a tpuboot restart does
  not restart the container); one whose image or settings differ is removed and created again;
- a missing image is pulled, ``pull_retries`` times at most, with the credentials
  ``credentials`` gives for its registry (:mod:`tpuboot.containers.credentials`: the VM's
  service-account token for Google's registries; none without it);
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

from tpuboot.containers.credentials import ANONYMOUS, PullCredentials, ServiceAccountCredentials
from tpuboot.containers.dockerapi import (
    DOCKER_SOCKET,
    DockerAPI,
    EventStream,
    NotFound,
    ProtocolError,
    Unreachable,
)
from tpuboot.containers.imageref import ImageRefused, RegistryAllowlist
from tpuboot.containers.supervisor import CannotStart, Refused, RuntimeUnavailable, Started, StartFailed

log = logging.getLogger("tpuboot.containers.docker")

MANAGED_LABEL = "io.tpuboot.managed"
CONFIG_LABEL = "io.tpuboot.config"
PULL_PAUSE_MAX = 8.0


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

    def create_config(self) -> dict[str, Any]:
        """The Engine API body of ``POST /containers/create`` for this container."""
        host_config: dict[str, Any] = {"Privileged": True, "NetworkMode": "host"}
        if self.binds:
            host_config["Binds"] = [f"{host}:{inside}:ro" for host, inside in self.binds]
        return {"Image": self.image, "Labels": self.labels, "HostConfig": host_config}

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


def _unreachable(exc: BaseException) -> bool:
    """An error saying dockerd is not there (as opposed to an answer from it)."""
    return isinstance(exc, (Unreachable, OSError))


def _reason(exc: BaseException) -> str:
    """One line for a status or log: dockerd's own message when it answered."""
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


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


class DockerRuntime:
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
        when its socket does not answer so that STATUS says what vBar waits for."""
        self.spec = spec
        self.installed = installed
        self.allowlist = allowlist
        self.credentials = credentials
        self.pull_retries = pull_retries
        self.client_factory = client_factory
        self.client: DockerAPI | None = None
        self.container_id: str | None = None
        self._running: ContainerSpec | None = None  # the spec of the container being followed
        self._refused: ContainerSpec | None = None  # the spec start() last refused
        self.fields: dict[str, str] = {"CONTAINER": spec().name}
        self._stream: EventStream | None = None
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
        self._refused = None
        try:
            self.allowlist.check(spec.image, spec.origin)  # before dockerd is even asked
        except ImageRefused as exc:
            self._refused = spec
            raise Refused(str(exc)) from None
        if spec.problem:
            raise CannotStart(spec.problem)
        try:
            started = self._start(spec)
        except (RuntimeUnavailable, CannotStart, StartFailed):
            raise
        except Exception as exc:
            if isinstance(exc, ProtocolError):  # answering, but not as dockerd: reconnect later
                self._drop_client()
                raise RuntimeUnavailable(_reason(exc)) from None
            if _unreachable(exc):
                self._drop_client()
                raise RuntimeUnavailable(self._unreachable_reason()) from None
            raise StartFailed(f"{spec.name}: {_reason(exc)}") from None
        self._running = spec
        return started

    def wait(self) -> str | None:
        client, ident = self.client, self.container_id
        if client is None or ident is None:
            return None
        try:
            stream = client.events({"type": ["container"], "container": [ident], "event": ["die"]})
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            self._drop_client()
            raise RuntimeUnavailable(f"dockerd not answering ({_reason(exc)})") from None
        with self._lock:
            self._stream = stream
        broken: str | None = None  # why the stream failed, when dockerd sent what no event is
        try:
            if self._interrupted.is_set():
                return None
            # Subscribed first, then looked: a death before the subscription shows here.
            state = client.inspect_container(ident).get("State") or {}
            if not state.get("Running"):
                return f"exit {state.get('ExitCode', '?')}"
            for event in stream:  # ends when dockerd ends the stream or goes away, or at _cut
                if event.get("Action") == "die" or event.get("status") == "die":
                    code = ((event.get("Actor") or {}).get("Attributes") or {}).get("exitCode", "?")
                    return f"exit {code}"
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            if not _unreachable(exc):
                return f"gone ({_reason(exc)})"  # removed by hand: start again
            if isinstance(exc, ProtocolError):
                broken = _reason(exc)
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        if self._interrupted.is_set():
            return None
        self._drop_client()
        raise RuntimeUnavailable(
            f"dockerd's event stream failed: {broken}" if broken else "dockerd went away"
        )

    def interrupt(self) -> bool:
        """Only when the wanted container changed from the one followed or refused: a tpu-env
        change elsewhere leaves it be."""
        current = self._running or self._refused
        if current is not None and not self._closed.is_set():
            try:
                if self.spec() == current:
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
            stream.close()  # a wait() blocked reading the stream returns at once

    def close(self) -> None:
        """Stop following the container; the container itself keeps running."""
        self._closed.set()
        self._cut()

    # ------------------------------------------------------------------ helpers

    def _client(self) -> DockerAPI:
        if self.client is None:
            client = self.client_factory()
            client.ping()  # learns dockerd's API version; raises here when dockerd is absent
            self.client = client
        return self.client

    def _unreachable_reason(self) -> str:
        if self.installed is not None and not self.installed():
            return "dockerd is not installed: apt install docker.io"
        return f"dockerd not answering on {DOCKER_SOCKET}"

    def _drop_client(self) -> None:
        """Forget the client: the next start asks dockerd's API version again (it may be another)."""
        self.client = None

    def _start(self, spec: ContainerSpec) -> Started:
        client = self._client()
        try:
            found: dict[str, Any] | None = client.inspect_container(spec.name)
        except NotFound:
            found = None
        how = "started"
        if found is not None:
            ident = str(found["Id"])
            if spec.matches(found):
                self.container_id = ident
                if (found.get("State") or {}).get("Running"):
                    return Started("adopted", ident[:12])
                client.start_container(ident)
                return Started("restarted", ident[:12])
            log.info(
                "%s: image or settings differ from the configuration; recreating it",
                spec.name,
                extra={"CONTAINER": spec.name, "IMAGE": spec.image},
            )
            with contextlib.suppress(NotFound):  # gone meanwhile: as good
                client.remove_container(ident, force=True)
            how = "recreated"
        self._ensure_image(client, spec.image)
        ident = client.create_container(spec.name, spec.create_config())
        self.container_id = ident
        client.start_container(ident)
        return Started(how, ident[:12])

    def _has_image(self, client: DockerAPI, image: str) -> bool:
        try:
            client.inspect_image(image)
        except NotFound:
            return False
        return True

    def _ensure_image(self, client: DockerAPI, image: str) -> None:
        if self._has_image(client, image):
            return
        repository, tag = split_image(image)
        tries = self.pull_retries + 1
        reason = ""
        sent: PullCredentials = ANONYMOUS
        for attempt in range(tries):
            if self._closed.is_set():
                raise RuntimeUnavailable("stopping")
            sent = self.credentials.for_image(image) if self.credentials is not None else ANONYMOUS
            try:
                client.pull_image(repository, tag, sent.auth)
                how = " with the VM's service-account token" if sent.auth is not None else ""
                log.info("pulled %s%s", image, how, extra={"IMAGE": image})
                return
            except Exception as exc:
                if _unreachable(exc):
                    raise
                reason = _reason(exc)
                if sent.auth is not None and self.credentials is not None and sent.advice(reason):
                    self.credentials.forget(sent.auth)  # refused: ask for a token afresh
            if attempt + 1 < tries:
                self._pause(min(PULL_PAUSE_MAX, 2.0**attempt))
                if self._has_image(client, image):  # loaded meanwhile (docker load / import at boot)
                    return
        raise CannotStart(
            f"cannot pull image {image} ({tries} tries: {reason}){sent.advice(reason)}; "
            "make it reachable, load it with `docker load`, or set another image"
        )
