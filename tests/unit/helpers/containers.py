"""What the container tests share: a status recorder, the host engine's runtime over the fake dockerd, and
the metadata server's service-account token as the credentials tests serve it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from harness.mds_emulator import MetadataEmulator
from tests.unit.fakes.dockerd import FakeDockerd
from tpuboot.backoff import Backoff
from tpuboot.component import Status
from tpuboot.config import DEFAULT_TOKEN_REGISTRIES
from tpuboot.containers.credentials import ServiceAccountCredentials
from tpuboot.containers.docker import DockerEngine
from tpuboot.containers.dockerapi import DockerAPI
from tpuboot.containers.engine import ContainerEngine, ContainerSpec
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.runtime import EngineRuntime, runtime_on
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root
from tpuboot.references import RegistryAllowlist


class Statuses:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, label: str, status: Status) -> None:
        with self.lock:
            self.lines.append(f"{label}: {status.detail}")

    @property
    def last(self) -> str:
        with self.lock:
            return self.lines[-1] if self.lines else ""


IMAGE = "example.invalid/vbar:1"


ALLOW_TEST = RegistryAllowlist(["example.invalid"], "vbar.registries")


def engine_of(fake: FakeDockerd, timeout: float | None = None) -> Callable[[], ContainerEngine]:
    """The daemon's seam for its engine, as a client of the fake dockerd."""
    if timeout is None:
        return lambda: DockerEngine(DockerAPI(str(fake.socket_path)))
    return lambda: DockerEngine(DockerAPI(str(fake.socket_path), timeout=timeout))


def docker_runtime(fake: FakeDockerd, spec: Callable[[], ContainerSpec] | None = None) -> EngineRuntime:
    return runtime_on(
        HOST_ENGINE,
        Root(fake.root),
        spec or (lambda: ContainerSpec("vbar", IMAGE)),
        pull_retries=2,
        client=engine_of(fake),
        pause=lambda s: None,
        allowlist=ALLOW_TEST,
    )


TOKEN = "ya29.c.b0AXv0zTP-test_token.~-" + "A" * 180


def token_answer(token: str = TOKEN, expires_in: object = 3599, token_type: str = "Bearer") -> str:
    return json.dumps({"access_token": token, "expires_in": expires_in, "token_type": token_type})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def client_of(emulator: MetadataEmulator) -> MetadataClient:
    return MetadataClient(emulator.url, timeout=0.5, backoff=Backoff(initial=0.01, maximum=0.02, floor=0.01))


def credentials(
    emulator: MetadataEmulator,
    registries: tuple[str, ...] = DEFAULT_TOKEN_REGISTRIES,
    clock: Clock | None = None,
) -> ServiceAccountCredentials:
    return ServiceAccountCredentials(client_of(emulator), registries, deadline_s=0.5, clock=clock or Clock())


GCR_IMAGE = "gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1"


ALLOW = RegistryAllowlist(["gcr.io", "registry.example:5000"], "vbar.registries")


def runtime(dockerd: FakeDockerd, image: str, source: ServiceAccountCredentials | None) -> EngineRuntime:
    return runtime_on(
        HOST_ENGINE,
        Root(dockerd.root),
        lambda: ContainerSpec("vbar", image),
        pull_retries=1,
        client=engine_of(dockerd),
        pause=lambda s: None,
        allowlist=ALLOW,
        credentials=source,
    )
