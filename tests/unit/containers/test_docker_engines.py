"""The vBar supervisor and the doctor against each Docker engine tpuboot meets (fakes.dockerd.ENGINES):
Debian 12's docker.io 20.10 (API 1.41), Docker 29 from Ubuntu's docker.io or docker-ce (API 1.52,
minimum 1.44: nothing older is accepted), and an engine newer than tpuboot knows."""

from __future__ import annotations

import re

import pytest

from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.dockerd import ENGINES, FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import (
    GCR_IMAGE,
    IMAGE,
    TOKEN,
    Statuses,
    credentials,
    docker_runtime,
    runtime,
    token_answer,
)
from tpuboot.backoff import RestartPolicy
from tpuboot.checks.containers import engine_container_state
from tpuboot.checks.doctor import Doctor
from tpuboot.config import Config
from tpuboot.containers.credentials import TOKEN_USERNAME
from tpuboot.containers.dockerwire import DockerError
from tpuboot.containers.engine import ContainerSpec
from tpuboot.containers.supervisor import StartFailed, Supervisor
from tpuboot.paths import Root

SPOKEN = {"debian12": "1.41", "docker29": "1.52", "future": "1.52"}


def versions_used(fake: FakeDockerd) -> list[str]:
    """The /v1.xx prefix of every versioned request, in order."""
    return [m.group(1) for p in fake.paths() if (m := re.match(r"/v(\d+\.\d+)/", p))]


@pytest.mark.parametrize(
    ("before", "after"),
    [("debian12", "docker29"), ("docker29", "future"), ("docker29", "debian12"), ("future", "docker29")],
)
def test_supervisor_runs_vbar_on_each_engine_and_across_a_dockerd_upgrade(before: str, after: str) -> None:
    """Started, restarted after a die, then dockerd replaced by another engine (apt upgrade or
    downgrade restarts it): vBar runs again, every request in a version that engine accepts."""
    with fake_dockerd(*ENGINES[before]) as fake:
        fake.images.add(IMAGE)
        status = Statuses()
        runtime = docker_runtime(fake, lambda: ContainerSpec("vbar", IMAGE))
        fast = RestartPolicy(initial=0.05, maximum=0.2, stable_after=30.0)
        supervisor = Supervisor("vBar", runtime, fast, status)
        supervisor.start()
        try:
            wait_until(lambda: status.last == "vBar: running" and len(fake.subscribers) == 1)
            fake.die("vbar", 1)
            wait_until(lambda: status.last == "vBar: running" and len(fake.subscribers) == 2)
            assert set(versions_used(fake)) == {SPOKEN[before]}

            fake.stop()
            wait_until(lambda: "waiting" in status.last)
            fake.api_version, fake.min_api_version, fake.engine_version = ENGINES[after]
            seen = len(fake.paths())
            fake.start()
            wait_until(lambda: status.last == "vBar: running" and len(fake.subscribers) == 3, timeout=15)
            assert fake.running("vbar")
        finally:
            supervisor.stop()
    after_upgrade = fake.paths()[seen:]
    assert after_upgrade[0] == "/version"
    assert {p.split("/")[1] for p in after_upgrade[1:]} == {f"v{SPOKEN[after]}"}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_doctors_probe_on_each_engine(engine: str) -> None:
    with fake_dockerd(*ENGINES[engine]) as fake:
        root = Root(fake.root)
        assert engine_container_state(root, "vbar") == "absent"
        fake.add_container("vbar", IMAGE)
        assert engine_container_state(root, "vbar") == "running"
    assert set(versions_used(fake)) == {SPOKEN[engine]}


def test_an_engine_with_no_version_in_common_is_a_start_failure_and_a_doctor_fail() -> None:
    """Not "dockerd absent" (which waits quietly): a one-line reason saying what to upgrade."""
    with fake_dockerd("1.70", "1.60", "40.0.0") as fake:
        fake.images.add(IMAGE)
        with pytest.raises(StartFailed) as caught:
            docker_runtime(fake).start()
        with pytest.raises(DockerError):
            engine_container_state(Root(fake.root), "vbar")
        verdicts = Doctor(Root(fake.root), Config(gke="false")).checks.run(Root(fake.root))
    assert str(caught.value) == (
        "vbar: dockerd accepts Engine API 1.60 to 1.70 and tpuboot speaks 1.24 to 1.52: upgrade tpuboot"
    )
    (vbar,) = [v for v in verdicts if v.name == "vbar-running"]
    assert vbar.status == "FAIL" and vbar.detail.endswith("upgrade tpuboot") and vbar.fix
    assert versions_used(fake) == []


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_pull_from_a_token_registry_authenticates_on_each_engine(engine: str) -> None:
    """The header is decoded as each engine decodes it; 20.10 would drop a malformed one silently."""
    with (
        fake_dockerd(*ENGINES[engine]) as fake,
        MetadataEmulator(instance={"service-accounts/default/token": token_answer()}) as mds,
    ):
        fake.registry_credentials["gcr.io"] = (TOKEN_USERNAME, TOKEN)
        assert runtime(fake, GCR_IMAGE, credentials(mds)).start().how == "started"
        assert fake.pull_auths == [{"username": TOKEN_USERNAME, "password": TOKEN, "serveraddress": "gcr.io"}]
        assert set(versions_used(fake)) == {SPOKEN[engine]}
