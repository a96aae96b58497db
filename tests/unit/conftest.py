"""Fixtures for the metadata and environment tests: an emulator on 127.0.0.1, a client, a temp Root.

No test reaches anything but the loopback range: a TCP connection elsewhere (a real metadata
server, the internet) fails the test. The guard is the process's audit hook (PEP 578,
``sys.addaudithook``) on the ``socket.connect`` event, switched on around every unit test by the
autouse fixture :func:`loopback_only`: nothing in tpuboot or the libraries is patched, and a test
cannot lift it by accident (``monkeypatch.undo()``, a patch of ``socket`` of its own, a library
that keeps a reference to the real ``connect``: audit hooks cannot be removed and see every
connect, through whichever name it is called). The same hook lets a test watch the events of a
block of code (:func:`audit_events`), where it would otherwise patch ``os`` to spy on calls.
Another fixture puts the ``tpuboot`` logger back after each test: `cli.main` points it at the
stderr of the moment, which pytest closes when the test ends, and a thread still stopping would
otherwise print "--- Logging error ---".
A DeprecationWarning raised from tpuboot's code is an error: what is deprecated on this Python
and these libraries is gone on a newer one (3.12, 3.13, urllib3 2.x), which does not run here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from tpuboot.backoff import Backoff
from tpuboot.config import Config, EnvConfig, MetadataConfig
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait, in the test's thread, until ``predicate()`` holds (another thread makes it so)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _is_loopback(address: object) -> bool:
    host = str(address[0]) if isinstance(address, tuple) and address else str(address)
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


class _Audit:
    """The test process's one audit hook: the loopback guard, and the recorders of audit_events."""

    def __init__(self) -> None:
        self.guard = False
        self.recorders: list[list[tuple[str, tuple[object, ...]]]] = []

    def __call__(self, event: str, args: tuple[object, ...]) -> None:
        if self.guard and event == "socket.connect":
            sock, address = args
            inet = isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6)
            if inet and not _is_loopback(address):
                raise AssertionError(f"test tried to connect to {address!r}; tests may only reach 127.0.0.1")
        for recorder in list(self.recorders):
            recorder.append((event, args))


AUDIT = _Audit()
sys.addaudithook(AUDIT)


@contextlib.contextmanager
def audit_events() -> Iterator[list[tuple[str, tuple[object, ...]]]]:
    """The audit events (``os.listdir``, ``open``, ...) raised in the block, by any thread."""
    seen: list[tuple[str, tuple[object, ...]]] = []
    AUDIT.recorders.append(seen)
    try:
        yield seen
    finally:
        AUDIT.recorders.remove(seen)


_OVERRIDES = ("GCE_METADATA_HOST", "GCE_METADATA_ROOT", "http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY")


@pytest.fixture(autouse=True)
def loopback_only() -> Iterator[None]:
    """No test talks to anything but 127.0.0.1; no inherited override points the client elsewhere.

    Its own MonkeyPatch: a test's ``monkeypatch.undo()`` puts back none of these variables.
    """
    with pytest.MonkeyPatch.context() as env:
        for name in _OVERRIDES:
            env.delenv(name, raising=False)
        AUDIT.guard = True
        try:
            yield
        finally:
            AUDIT.guard = False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "error::DeprecationWarning:tpuboot")
    config.addinivalue_line("filterwarnings", "error::PendingDeprecationWarning:tpuboot")


@pytest.fixture(autouse=True)
def tpuboot_logger() -> Iterator[None]:
    """The ``tpuboot`` logger as it was before the test (handlers, level, propagation)."""
    logger = logging.getLogger("tpuboot")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def emulator() -> Iterator[MetadataEmulator]:
    """A running emulator holding the sample tpu-env and a few other keys."""
    emu = MetadataEmulator(
        {"tpu-env": tpu_env_yaml(SAMPLE_TPU_ENV), "startup-script": "#!/bin/sh\n"},
        project_attributes={"ssh-keys": "alice:ssh-ed25519 AAAA alice"},
        instance={"hostname": "t1v-n-0.example.internal", "zone": "projects/1/zones/us-east5-a"},
    )
    with emu:
        yield emu


FAST_BACKOFF = Backoff(initial=0.01, maximum=0.05, floor=0.01)


def make_client(emu: MetadataEmulator, *, timeout: float = 2.0, max_body: int = 1 << 20) -> MetadataClient:
    """A client for ``emu`` with quick backoff (tests wait on deadlines, not on real boot pacing)."""
    return MetadataClient(
        emu.url,
        timeout=timeout,
        max_body=max_body,
        backoff=FAST_BACKOFF,
        rng=random.Random(7),
        min_poll_interval=0.05,
    )


@pytest.fixture
def client(emulator: MetadataEmulator) -> Iterator[MetadataClient]:
    c = make_client(emulator)
    yield c
    c.close()


#: The SMBIOS system UUID of the ``root`` tree's instance.
INSTANCE_UUID = "5d1c3a7e-0b6f-4e2a-9c41-7f3e2d1b0a98"


@pytest.fixture
def root(tmp_path: Path) -> Root:
    """A temporary host tree with /etc and /home/tpu-runtime, as on a TPU VM image."""
    (tmp_path / "root" / "etc").mkdir(parents=True)
    (tmp_path / "root" / "home" / "tpu-runtime").mkdir(parents=True)
    dmi = tmp_path / "root" / "sys" / "class" / "dmi" / "id"  # the instance's identity (envsync)
    dmi.mkdir(parents=True)
    (dmi / "product_uuid").write_text(INSTANCE_UUID + "\n")
    return Root(tmp_path / "root")


def make_config(emu: MetadataEmulator | None = None, **env: object) -> Config:
    """A Config pointing at ``emu``, with EnvConfig fields overridden by ``env``."""
    metadata = MetadataConfig(host=emu.host if emu else None, timeout=2.0)
    return Config(metadata=metadata, env=EnvConfig(**env))  # type: ignore[arg-type]
