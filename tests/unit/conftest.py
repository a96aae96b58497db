"""Fixtures for the metadata and environment tests: an emulator on 127.0.0.1, a client, a temp Root.

No test reaches anything but the loopback range: a TCP connection elsewhere (a real metadata
server, the internet) fails the test. The guard is the process's audit hook (PEP 578,
``sys.addaudithook``) on the ``socket.connect`` event, switched on around every unit test by the
autouse fixture :func:`loopback_only`: nothing in tpuboot or the libraries is patched, and a test
cannot lift it by accident (``monkeypatch.undo()``, a patch of ``socket`` of its own, a library
that keeps a reference to the real ``connect``: audit hooks cannot be removed and see every
connect, through whichever name it is called). The same hook lets a test watch the events of a
block of code (``audit_events``, tests/unit/helpers/audit.py), where it would otherwise patch
``os`` to spy on calls.
A test that leaves ``os.environ`` changed fails (:func:`environment_as_found`): a WATCHDOG_USEC
left set once made every later daemon test of its worker see a watchdog. Another fixture puts the
``tpuboot`` logger back after each test: `cli.main` points it at the
stderr of the moment, which pytest closes when the test ends, and a thread still stopping would
otherwise print "--- Logging error ---".
A DeprecationWarning raised from tpuboot's code is an error: what is deprecated on this Python
and these libraries is gone on a newer one (3.12, 3.13, urllib3 2.x), which does not run here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from tests.unit.helpers.audit import AUDIT
from tests.unit.helpers.metadata import INSTANCE_UUID, make_client
from tpuboot import metrics
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

PYTEST_OWN = "PYTEST_CURRENT_TEST"
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
def environment_as_found() -> Iterator[None]:
    """The test fails if it leaves ``os.environ`` changed (``monkeypatch``'s changes are undone
    before this looks: it is set up first, so torn down last); the environment is put back."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    before.pop(PYTEST_OWN, None)  # pytest's own, set for each phase of a test
    after.pop(PYTEST_OWN, None)
    if after != before:
        changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
        for name in changed:
            if name in before:
                os.environ[name] = before[name]
            else:
                del os.environ[name]
        pytest.fail(f"the test left os.environ changed: {', '.join(changed)}; use monkeypatch")


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


@pytest.fixture
def client(emulator: MetadataEmulator) -> Iterator[MetadataClient]:
    c = make_client(emulator)
    yield c
    c.close()


@pytest.fixture
def root(tmp_path: Path) -> Root:
    """A temporary host tree with /etc and /home/tpu-runtime, as on a TPU VM image."""
    (tmp_path / "root" / "etc").mkdir(parents=True)
    (tmp_path / "root" / "home" / "tpu-runtime").mkdir(parents=True)
    dmi = tmp_path / "root" / "sys" / "class" / "dmi" / "id"  # the instance's identity (envsync)
    dmi.mkdir(parents=True)
    (dmi / "product_uuid").write_text(INSTANCE_UUID + "\n")
    return Root(tmp_path / "root")


@pytest.fixture
def recorded() -> Iterator[metrics.Metrics]:
    """A fresh metrics recorder that every update goes to during the test."""
    with metrics.use(metrics.Metrics()) as fresh:
        yield fresh
