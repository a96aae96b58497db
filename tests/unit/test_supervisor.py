"""The supervisor loop over the exec runtime (a stand-in binary) and the docker runtime (a fake client)."""

from __future__ import annotations

import asyncio
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors
import pytest
import requests

from tests.unit.test_daemon import until
from tpuboot import metrics
from tpuboot.agents import Agents, vbar_image
from tpuboot.backoff import RestartPolicy
from tpuboot.children import ExecRuntime, describe_exit
from tpuboot.config import Config, TelemetryConfig, VbarConfig
from tpuboot.containers import CONFIG_LABEL, MANAGED_LABEL, ContainerSpec, DockerRuntime, split_image
from tpuboot.gke import gke_node
from tpuboot.supervisor import CannotStart, RuntimeUnavailable, Supervisor
from tpuboot.tpuenv import parse_env_file, render_env_file


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class Statuses:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            self.lines.append(text)

    @property
    def last(self) -> str:
        with self.lock:
            return self.lines[-1] if self.lines else ""


def stand_in(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "vbar_stand_in.py"
    script.write_text("import os, signal, sys, time\n" + body)
    return [sys.executable, str(script), str(tmp_path)]


FAST = RestartPolicy(initial=0.05, maximum=0.2, stable_after=30.0)


# --------------------------------------------------------------------------- exec runtime


def test_exec_child_runs_and_gets_sigterm_at_stop(tmp_path: Path) -> None:
    argv = stand_in(
        tmp_path,
        "d = sys.argv[1]\n"
        "signal.signal(signal.SIGTERM, lambda *a: (open(d + '/term', 'w').close(), sys.exit(0)))\n"
        "open(d + '/up', 'w').close()\n"
        "time.sleep(60)\n",
    )
    status = Statuses()
    runtime = ExecRuntime(argv)
    supervisor = Supervisor("vBar", runtime, RestartPolicy(), status)
    supervisor.start()
    wait_until(lambda: (tmp_path / "up").exists() and status.last == "vBar: running")
    supervisor.stop()
    assert (tmp_path / "term").exists()
    assert runtime.proc is not None and runtime.proc.returncode == 0
    assert supervisor.starts == 1
    assert supervisor._thread is not None and not supervisor._thread.is_alive()


def test_a_crashing_child_is_restarted_with_growing_delays(tmp_path: Path) -> None:
    argv = stand_in(tmp_path, "open(sys.argv[1] + '/runs', 'a').write('x')\nsys.exit(3)\n")
    status = Statuses()
    supervisor = Supervisor("vBar", ExecRuntime(argv), FAST, status)
    with metrics.use(metrics.Metrics()) as counted:
        registry = counted.registry
        supervisor.start()
        wait_until(lambda: len((tmp_path / "runs").read_text() if (tmp_path / "runs").exists() else "") >= 5)
        wait_until(lambda: "crash loop" in status.last)
        supervisor.stop()
    assert supervisor.delays[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert "exit 3" in status.last
    restarts = registry.get_sample_value("tpuboot_container_restarts_total", {"container": "vBar"})
    assert restarts == len(supervisor.delays)


def test_a_child_ignoring_sigterm_is_killed_after_the_bound(tmp_path: Path) -> None:
    argv = stand_in(
        tmp_path,
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(sys.argv[1] + '/up', 'w').close()\n"
        "time.sleep(60)\n",
    )
    runtime = ExecRuntime(argv, term_timeout=0.3)
    supervisor = Supervisor("vBar", runtime, RestartPolicy(), Statuses())
    supervisor.start()
    wait_until(lambda: (tmp_path / "up").exists())
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 5
    assert runtime.proc is not None and runtime.proc.returncode == -signal.SIGKILL


def test_a_missing_program_is_a_failed_start_with_backoff(tmp_path: Path) -> None:
    status = Statuses()
    supervisor = Supervisor("vBar", ExecRuntime([str(tmp_path / "absent")]), FAST, status)
    supervisor.start()
    wait_until(lambda: len(supervisor.delays) >= 3)
    supervisor.stop()
    assert "start failed: cannot run" in status.last
    assert supervisor.starts == 0


def test_describe_exit() -> None:
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-9) == "killed by SIGKILL"


# --------------------------------------------------------------------------- docker runtime


class FakeStream:
    def __init__(self) -> None:
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> dict[str, Any]:
        event = self.events.get()
        if event is None:
            raise StopIteration
        return event

    def close(self) -> None:
        self.events.put(None)


class FakeContainer:
    def __init__(self, client: FakeClient, ident: str, image: str, name: str, **kw: Any) -> None:
        self.client = client
        self.id = ident
        self.attrs: dict[str, Any] = {
            "Name": "/" + name,
            "Config": {"Image": image, "Labels": kw.get("labels") or {}},
            "HostConfig": {
                "Privileged": kw.get("privileged", False),
                "NetworkMode": kw.get("network_mode", ""),
            },
            "State": {"Running": False, "ExitCode": 0},
        }
        self.create_kwargs = kw

    def start(self) -> None:
        self.attrs["State"] = {"Running": True, "ExitCode": 0}

    def remove(self, force: bool = False) -> None:
        self.client.removed.append(self.id)
        self.client.by_name.pop(self.attrs["Name"][1:], None)

    def die(self, code: int) -> None:
        self.attrs["State"] = {"Running": False, "ExitCode": code}
        for stream in self.client.streams:
            stream.events.put(
                {"status": "die", "id": self.id, "Actor": {"Attributes": {"exitCode": str(code)}}}
            )


class FakeClient:
    """The few docker SDK methods DockerRuntime uses, over in-memory state."""

    def __init__(self) -> None:
        self.images_present: set[str] = set()
        self.pull_error: Exception | None = None
        self.pulls: list[tuple[str, str]] = []
        self.by_name: dict[str, FakeContainer] = {}
        self.removed: list[str] = []
        self.created: list[FakeContainer] = []
        self.streams: list[FakeStream] = []
        self.up = True
        self.containers = self
        self.images = self

    # client
    def ping(self) -> bool:
        if not self.up:
            raise requests.exceptions.ConnectionError("connection refused")
        return True

    def close(self) -> None:
        pass

    def events(self, decode: bool, filters: dict[str, Any]) -> FakeStream:
        self.ping()
        stream = FakeStream()
        self.streams.append(stream)
        return stream

    def dockerd_dies(self) -> None:
        self.up = False
        for container in self.by_name.values():
            container.attrs["State"] = {"Running": False, "ExitCode": 0}
        for stream in self.streams:
            stream.close()

    # client.containers / client.images: get() serves both
    def get(self, key: str) -> Any:
        self.ping()
        if key in self.images_present:
            return object()
        for container in self.by_name.values():
            if key in (container.id, container.attrs["Name"][1:]):
                return container
        if "/" in key or ":" in key:
            raise docker.errors.ImageNotFound(key)
        raise docker.errors.NotFound(key)

    def create(self, image: str, name: str, **kw: Any) -> FakeContainer:
        if image not in self.images_present:
            raise docker.errors.ImageNotFound(image)
        container = FakeContainer(self, f"{len(self.created) + 1:064x}", image, name, **kw)
        self.by_name[name] = container
        self.created.append(container)
        return container

    def pull(self, repository: str, tag: str) -> None:
        self.pulls.append((repository, tag))
        if self.pull_error is not None:
            raise self.pull_error
        self.images_present.add(f"{repository}:{tag}")


IMAGE = "example.invalid/vbar:1"


def docker_runtime(client: FakeClient, spec: Callable[[], ContainerSpec] | None = None) -> DockerRuntime:
    return DockerRuntime(
        spec or (lambda: ContainerSpec("vbar", IMAGE)),
        pull_retries=2,
        client_factory=lambda: client,
        pause=lambda s: None,
    )


def test_docker_creates_a_labelled_privileged_host_network_container_pulling_the_image() -> None:
    client = FakeClient()
    started = docker_runtime(client).start()
    assert started.how == "started"
    assert client.pulls == [("example.invalid/vbar", "1")]
    (container,) = client.created
    assert container.create_kwargs["privileged"] is True
    assert container.create_kwargs["network_mode"] == "host"
    labels = container.create_kwargs["labels"]
    assert labels[MANAGED_LABEL] == "1" and labels[CONFIG_LABEL] == ContainerSpec("vbar", IMAGE).config_hash
    assert container.attrs["State"]["Running"]


def test_docker_adopts_a_running_matching_container_and_recreates_a_different_one() -> None:
    client = FakeClient()
    client.images_present.add(IMAGE)
    docker_runtime(client).start()
    first = client.created[0]
    assert docker_runtime(client).start().how == "adopted"  # a tpuboot restart
    assert len(client.created) == 1
    first.attrs["State"]["Running"] = False
    assert docker_runtime(client).start().how == "restarted"
    assert len(client.created) == 1

    client.images_present.add("example.invalid/vbar:2")
    runtime = docker_runtime(client, lambda: ContainerSpec("vbar", "example.invalid/vbar:2"))
    assert runtime.start().how == "recreated"
    assert client.removed == [first.id] and len(client.created) == 2
    assert client.created[1].attrs["Config"]["Image"] == "example.invalid/vbar:2"


def test_docker_recreates_a_container_with_the_name_but_not_privileged() -> None:
    client = FakeClient()
    client.images_present.add(IMAGE)
    spec = ContainerSpec("vbar", IMAGE)
    client.create(IMAGE, "vbar", labels=spec.labels, network_mode="host").start()
    assert docker_runtime(client).start().how == "recreated"


def test_a_pull_that_cannot_succeed_is_one_line_after_bounded_tries() -> None:
    client = FakeClient()
    client.pull_error = docker.errors.APIError(
        "500", explanation="Get https://x: dial tcp: lookup x: no such host"
    )
    with pytest.raises(CannotStart) as caught:
        docker_runtime(client).start()
    assert len(client.pulls) == 3  # pull_retries=2
    assert "\n" not in str(caught.value) and "cannot pull image example.invalid/vbar:1" in str(caught.value)
    assert "no such host" in str(caught.value)


def test_dockerd_absent_is_unavailable_not_a_failure() -> None:
    client = FakeClient()
    client.up = False
    with pytest.raises(RuntimeUnavailable):
        docker_runtime(client).start()


def test_wait_returns_the_exit_of_a_die_event_and_none_when_interrupted() -> None:
    client = FakeClient()
    client.images_present.add(IMAGE)
    runtime = docker_runtime(client)
    runtime.start()
    result: list[str | None] = []
    thread = threading.Thread(target=lambda: result.append(runtime.wait()))
    thread.start()
    wait_until(lambda: bool(client.streams))
    client.created[0].die(137)
    thread.join(5)
    assert result == ["exit 137"]

    runtime.start()
    assert runtime.interrupt() is False  # same spec: nothing to do
    runtime.close()
    assert runtime.wait() is None


def test_supervisor_over_docker_restarts_after_die_and_recovers_from_dockerd_restart() -> None:
    client = FakeClient()
    client.images_present.add(IMAGE)
    image = [IMAGE]
    status = Statuses()
    runtime = docker_runtime(client, lambda: ContainerSpec("vbar", image[0]))
    supervisor = Supervisor("vBar", runtime, FAST, status)
    supervisor.start()
    try:
        wait_until(lambda: status.last == "vBar: running" and len(client.streams) == 1)
        client.created[0].die(1)
        wait_until(lambda: status.last == "vBar: running" and len(client.streams) == 2)
        assert supervisor.starts == 2 and len(client.created) == 1  # restarted in place

        client.dockerd_dies()
        wait_until(lambda: "waiting" in status.last)
        client.up = True
        wait_until(lambda: status.last == "vBar: running" and len(client.streams) == 3, timeout=15)

        image[0] = "example.invalid/vbar:2"
        client.images_present.add(image[0])
        supervisor.reconfigure()
        wait_until(lambda: len(client.created) == 2 and status.last == "vBar: running")
        assert client.created[1].attrs["Config"]["Image"] == "example.invalid/vbar:2"
    finally:
        supervisor.stop()
    assert client.by_name["vbar"].attrs["State"]["Running"]  # stopping tpuboot leaves it running


# --------------------------------------------------------------------------- helpers


def test_the_tpu_env_file_reads_back_every_value() -> None:
    values = {"A": "gcr.io/x/y:1", "B": "", "C": 'q"$`\\ \nz', "D": "a,b"}
    assert parse_env_file(render_env_file(values)) == values


def test_split_image() -> None:
    assert split_image("gcr.io/p/vbar:0.0.1") == ("gcr.io/p/vbar", "0.0.1")
    assert split_image("localhost:5000/vbar") == ("localhost:5000/vbar", "latest")


# --------------------------------------------------------------------------- in the daemon


def daemon_with(kernel: Any, agents: Agents) -> Any:
    from tests.unit.test_daemon import QueueMonitor, RecordingNotifier
    from tests.unit.test_vfio import binder
    from tpuboot.daemon import Daemon

    return Daemon(binder(kernel), QueueMonitor(), RecordingNotifier(), agents=agents)


@pytest.fixture
def kernel(tmp_path: Path) -> Any:
    from tests.unit.fakekernel import FakeKernel
    from tests.unit.test_vfio import V5P, add_tpu

    k = FakeKernel(tmp_path / "kernel")
    add_tpu(k, "0000:00:04.0", V5P, driver=None, group="4")
    return k


def test_ready_never_waits_for_dockerd_and_the_status_says_so(kernel: Any, root: Any) -> None:
    def no_dockerd() -> Any:
        raise requests.exceptions.ConnectionError("no such file")

    agents = Agents(Config(gke="false"), root, None, docker_factory=no_dockerd)

    async def scenario() -> None:
        daemon = daemon_with(kernel, agents)
        task = asyncio.create_task(daemon.run())
        await until(lambda: daemon.ready)
        await until(lambda: "vBar: waiting (dockerd not answering" in daemon.notifier.last_status)
        assert daemon.notifier.last_status.startswith("1 TPU bound to vfio-pci; vBar: waiting")
        daemon.stopping.set()
        await asyncio.wait_for(task, 10.0)

    asyncio.run(scenario())


def test_on_a_gke_node_neither_agent_starts(kernel: Any, root: Any) -> None:
    def never() -> Any:
        raise AssertionError("docker must not be used on GKE")

    config = Config(gke="true", telemetry=TelemetryConfig(enabled=True))
    agents = Agents(config, root, None, docker_factory=never)

    async def scenario() -> None:
        daemon = daemon_with(kernel, agents)
        task = asyncio.create_task(daemon.run())
        await until(lambda: "telemetry: not started" in daemon.notifier.last_status)
        assert daemon.status_line().endswith(
            "vBar: not started, GKE node (GKE runs it); "
            "telemetry: not started, GKE node (GKE runs the telemetry collector)"
        )
        daemon.stopping.set()
        await asyncio.wait_for(task, 10.0)

    asyncio.run(scenario())


class FakeMetadata:
    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.asked: list[str] = []

    def get(self, path: str, *, deadline_s: float) -> object:
        from tpuboot.metadata import MetadataAbsent

        self.asked.append(path)
        if path.rsplit("/", 1)[-1] not in self.present:
            raise MetadataAbsent(path)
        return object()


def test_gke_auto_asks_metadata_and_forced_modes_do_not() -> None:
    stop = threading.Event()
    assert gke_node("auto", FakeMetadata({"kube-env"}), stop) is True
    plain = FakeMetadata(set())
    assert gke_node("auto", plain, stop) is False
    assert plain.asked == ["instance/attributes/cluster-name", "instance/attributes/kube-env"]
    assert gke_node("true", plain, stop) is True and gke_node("false", plain, stop) is False
    assert len(plain.asked) == 2


def test_exec_runtime_from_config_and_stop_ends_the_child(kernel: Any, root: Any, tmp_path: Path) -> None:
    argv = stand_in(tmp_path, "open(sys.argv[1] + '/up', 'w').close()\ntime.sleep(60)\n")
    config = Config(gke="false", vbar=VbarConfig(runtime="exec", exec_argv=tuple(argv)))
    agents = Agents(config, root, None)

    async def scenario() -> None:
        daemon = daemon_with(kernel, agents)
        task = asyncio.create_task(daemon.run())
        await until(lambda: daemon.status_line().endswith("vBar: running"))
        daemon.stopping.set()
        await asyncio.wait_for(task, 10.0)

    asyncio.run(scenario())
    runtime = agents.supervisors["vBar"].runtime
    assert isinstance(runtime, ExecRuntime) and runtime.proc is not None
    assert runtime.proc.returncode == -signal.SIGTERM


def test_vbar_image_comes_from_tpu_env_else_the_config(root: Any) -> None:
    config = Config()
    path = root.path(config.env.tpu_env_path)
    assert vbar_image(config, root) == config.vbar.image
    path.write_text(render_env_file({"VBARCONTROL_AGENT_DOCKER_URL": ""}))
    assert vbar_image(config, root) == config.vbar.image
    path.write_text(render_env_file({"A": "1", "VBARCONTROL_AGENT_DOCKER_URL": "local/vbar:2"}))
    assert vbar_image(config, root) == "local/vbar:2"
