"""The docker runtime (and the supervisor over it) against a fake dockerd on a real unix socket."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.polling import wait_until
from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tests.unit.helpers.containers import ALLOW_TEST, IMAGE, Statuses, docker_runtime, engine_of
from tpuboot.backoff import RestartPolicy
from tpuboot.checks.containers import engine_container_state
from tpuboot.component import Status
from tpuboot.config import Config, TelemetryConfig
from tpuboot.containers.agents import TELEMETRY_AGENT
from tpuboot.containers.docker import split_image
from tpuboot.containers.dockerapi import DOCKER_SOCKET
from tpuboot.containers.engine import CONFIG_LABEL, MANAGED_LABEL, ContainerSpec
from tpuboot.containers.engine import EngineUnreachable as Unreachable
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.containers.runtime import EngineRuntime, runtime_on
from tpuboot.containers.service import Containers
from tpuboot.containers.supervisor import CannotStart, RuntimeUnavailable, StartFailed, Supervisor
from tpuboot.paths import Root


def telemetry_spec(config: TelemetryConfig, root: Root) -> ContainerSpec:
    """The collector's container for a configuration whose telemetry section is ``config``."""
    return TELEMETRY_AGENT.container(Config(telemetry=config), root, None)


@pytest.fixture
def dockerd() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        yield fake


#: A container's inspect, as the fake's request log has it (unversioned).
INSPECT = r"/containers/[^/]+/json"


def waiting(runtime: EngineRuntime) -> tuple[threading.Thread, list[str | None], list[BaseException]]:
    """``runtime.wait()`` in a thread: its result or its error."""
    result: list[str | None] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(runtime.wait())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result, error


def test_creates_a_labelled_privileged_host_network_container_pulling_the_image(dockerd: FakeDockerd) -> None:
    started = docker_runtime(dockerd).start()
    assert started.how == "started"
    assert dockerd.pulls == [("example.invalid/vbar", "1")]
    (create,) = dockerd.calls("POST", "/containers/create")
    assert create.query == {"name": "vbar"}
    assert create.body == {
        "Image": IMAGE,
        "Labels": {MANAGED_LABEL: "1", CONFIG_LABEL: ContainerSpec("vbar", IMAGE).config_hash},
        "HostConfig": {"Privileged": True, "NetworkMode": "host"},
    }
    ident = dockerd.containers["vbar"]["Id"]
    assert started.ident == ident[:12] and dockerd.running("vbar")
    # Negotiated once, then every call in dockerd's version.
    assert dockerd.paths()[0] == "/version"
    assert all(path.startswith("/v1.41/") for path in dockerd.paths()[1:])


def test_binds_are_read_only(dockerd: FakeDockerd) -> None:
    dockerd.images.add("example.invalid/collector:1")
    spec = ContainerSpec("telemetry", "example.invalid/collector:1", (("/etc/c.yaml", "/etc/c.yaml"),))
    docker_runtime(dockerd, lambda: spec).start()
    (create,) = dockerd.calls("POST", "/containers/create")
    assert create.body["HostConfig"]["Binds"] == ["/etc/c.yaml:/etc/c.yaml:ro"]
    assert dockerd.pulls == []  # present: not pulled


def test_adopts_a_running_match_restarts_a_stopped_one_and_recreates_a_different_one(
    dockerd: FakeDockerd,
) -> None:
    dockerd.images.add(IMAGE)
    docker_runtime(dockerd).start()
    first = dockerd.containers["vbar"]["Id"]
    before = len(dockerd.requests)
    adopted = docker_runtime(dockerd).start()  # a tpuboot restart
    assert (adopted.how, adopted.ident) == ("adopted", first[:12])
    assert [r.method for r in dockerd.requests[before:]] == ["GET", "GET"]  # version, inspect: no change

    dockerd.die("vbar", 1)
    assert docker_runtime(dockerd).start().how == "restarted"
    assert dockerd.running("vbar") and dockerd.containers["vbar"]["Id"] == first
    assert len(dockerd.calls("POST", "/containers/create")) == 1

    dockerd.images.add("example.invalid/vbar:2")
    runtime = docker_runtime(dockerd, lambda: ContainerSpec("vbar", "example.invalid/vbar:2"))
    assert runtime.start().how == "recreated"
    (remove,) = dockerd.calls("DELETE", f"/containers/{first}")
    assert remove.query == {"force": "true"}
    assert dockerd.containers["vbar"]["Id"] != first
    assert dockerd.containers["vbar"]["Config"]["Image"] == "example.invalid/vbar:2"
    assert runtime.container_id == dockerd.containers["vbar"]["Id"] and dockerd.running("vbar")


def test_a_stopped_container_the_engine_cannot_start_again_is_recreated(
    dockerd: FakeDockerd, caplog: pytest.LogCaptureFixture
) -> None:
    """containerd keeps a task a dockerd restart left behind: every start of that container fails
    ("already exists") until it is removed, so it is removed and made again (the soak's vBar)."""
    dockerd.images.add(IMAGE)
    docker_runtime(dockerd).start()
    first = dockerd.containers["vbar"]["Id"]
    dockerd.die("vbar", 1)
    dockerd.stale_tasks.add(first)
    runtime = docker_runtime(dockerd)
    assert runtime.start().how == "recreated"
    assert dockerd.calls("DELETE", f"/containers/{first}")
    ident = dockerd.containers["vbar"]["Id"]
    assert ident != first and runtime.container_id == ident and dockerd.running("vbar")
    assert "vbar: cannot be started again (failed to create task for container: task" in caplog.text
    assert "already exists: unknown); recreating it" in caplog.text


def test_a_container_that_cannot_start_even_when_new_is_one_failed_start(dockerd: FakeDockerd) -> None:
    """Recreated once per start, not in a loop: a fresh container that fails too is the
    supervisor's to retry with its backoff."""
    dockerd.images.add(IMAGE)
    docker_runtime(dockerd).start()
    dockerd.die("vbar", 1)
    dockerd.stale_tasks.add(dockerd.containers["vbar"]["Id"])
    dockerd.stale_tasks.add(f"{2:064x}")  # the next id the fake gives
    refused = r"^vbar: failed to create task for container: task 0+2: already exists"
    with pytest.raises(StartFailed, match=refused):
        docker_runtime(dockerd).start()
    assert len(dockerd.calls("POST", "/containers/create")) == 2


def test_the_engines_message_is_escaped_in_the_log_and_the_failure(
    dockerd: FakeDockerd, caplog: pytest.LogCaptureFixture
) -> None:
    """dockerd's answer may echo another party's text: a control character in it is shown as an
    escape, never sent to the terminal or the journal as it is."""
    dockerd.images.add(IMAGE)
    docker_runtime(dockerd).start()
    dockerd.die("vbar", 1)
    first = dockerd.containers["vbar"]["Id"]
    dockerd.stale_tasks.add(first)
    dockerd.stale_tasks.add(f"{2:064x}")
    dockerd.stale_message = "task \x1b[2Jgone: already exists"
    with pytest.raises(StartFailed) as failed:
        docker_runtime(dockerd).start()
    assert str(failed.value) == "vbar: task \\x1b[2Jgone: already exists"
    assert "cannot be started again (task \\x1b[2Jgone: already exists)" in caplog.text
    assert "\x1b" not in caplog.text


def test_recreates_a_container_with_the_name_and_labels_but_not_privileged(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    old = dockerd.add_container("vbar", IMAGE, ContainerSpec("vbar", IMAGE).labels, privileged=False)
    assert docker_runtime(dockerd).start().how == "recreated"
    assert dockerd.containers["vbar"]["Id"] != old
    assert dockerd.containers["vbar"]["HostConfig"]["Privileged"] is True


def test_a_pull_failing_inside_its_stream_is_one_line_after_bounded_tries(dockerd: FakeDockerd) -> None:
    dockerd.pull_error = "Get https://x/v2/: dial tcp: lookup x on 10.0.0.2:53: no such host"
    with pytest.raises(CannotStart) as caught:
        docker_runtime(dockerd).start()
    assert len(dockerd.pulls) == 3  # pull_retries=2
    message = str(caught.value)
    assert "\n" not in message and message.startswith("cannot pull image example.invalid/vbar:1 (3 tries: ")
    assert "lookup x on 10.0.0.2:53: no such host" in message
    assert dockerd.calls("POST", "/containers/create") == []


def test_an_image_loaded_while_pulls_fail_is_used(dockerd: FakeDockerd) -> None:
    dockerd.pull_error = "no route to registry"
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # `docker load` at boot, meanwhile
        pauses.append(seconds)
        dockerd.images.add(IMAGE)

    runtime = runtime_on(
        HOST_ENGINE,
        Root(dockerd.root),
        lambda: ContainerSpec("vbar", IMAGE),
        pull_retries=5,
        client=engine_of(dockerd),
        pause=pause,
        allowlist=ALLOW_TEST,
    )
    assert runtime.start().how == "started"
    assert len(dockerd.pulls) == 1 and pauses == [1.0]


def test_dockerd_absent_is_unavailable_not_a_failure(dockerd: FakeDockerd) -> None:
    dockerd.stop()
    with pytest.raises(RuntimeUnavailable, match=r"dockerd is not installed: apt install docker\.io"):
        docker_runtime(dockerd).start()
    binary = Path(dockerd.root, HOST_ENGINE.binaries[0].lstrip("/"))
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.touch()
    with pytest.raises(RuntimeUnavailable, match=f"dockerd not answering on {DOCKER_SOCKET}"):
        docker_runtime(dockerd).start()


def test_dockerd_going_away_during_a_pull_is_unavailable(dockerd: FakeDockerd) -> None:
    dockerd.on_pull = lambda: threading.Thread(target=dockerd.stop).start()
    dockerd.pull_error = "never sent"
    with pytest.raises(RuntimeUnavailable):
        docker_runtime(dockerd).start()
    assert len(dockerd.pulls) == 1  # no retries against an absent dockerd


def test_wait_returns_the_exit_of_the_die_event(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    runtime = docker_runtime(dockerd)
    runtime.start()
    dockerd.add_container("other", IMAGE)
    thread, result, _ = waiting(runtime)
    wait_until(lambda: len(dockerd.subscribers) == 1)
    ident = dockerd.containers["vbar"]["Id"]
    (events,) = dockerd.calls("GET", "/events")
    filters = json.loads(events.query["filters"])
    assert filters == {"type": ["container"], "container": [ident], "event": ["die"]}
    dockerd.die("other", 2)
    dockerd.die("vbar", 137)
    thread.join(5)
    assert result == ["exit 137"]


def test_wait_with_an_engine_that_dropped_the_old_event_fields() -> None:
    """API 1.52 events have Action and Actor only (no status, id, from)."""
    with fake_dockerd("1.52", "1.44") as fake:
        fake.images.add(IMAGE)
        runtime = docker_runtime(fake)
        runtime.start()
        thread, result, _ = waiting(runtime)
        wait_until(lambda: len(fake.subscribers) == 1)
        fake.die("vbar", 3)
        thread.join(5)
    assert result == ["exit 3"]
    assert all(path.startswith("/v1.52/") for path in fake.paths()[1:])


def test_wait_sees_a_death_before_it_subscribed_and_a_container_removed_by_hand(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    runtime = docker_runtime(dockerd)
    runtime.start()
    dockerd.die("vbar", 9)
    assert runtime.wait() == "exit 9"
    runtime.start()
    del dockerd.containers["vbar"]
    assert runtime.wait() == f"gone (No such container: {runtime.container_id})"


@pytest.mark.parametrize("how", ["stream ends", "dockerd stops"])
def test_wait_raises_unavailable_when_the_event_stream_ends(dockerd: FakeDockerd, how: str) -> None:
    dockerd.images.add(IMAGE)
    runtime = docker_runtime(dockerd)
    runtime.start()
    looked = len(dockerd.calls("GET", INSPECT))
    thread, result, error = waiting(runtime)
    # Subscribed, and its look at the container answered (running), so the wait is on the stream:
    # a stop before that answer would rightly be seen as the container's exit.
    wait_until(
        lambda: (
            len(dockerd.subscribers) == 1
            and any(r.answered.is_set() for r in dockerd.calls("GET", INSPECT)[looked:])
        )
    )
    if how == "stream ends":
        dockerd.end_event_streams()
    else:
        dockerd.stop()
    thread.join(5)
    assert result == [] and len(error) == 1
    assert isinstance(error[0], RuntimeUnavailable) and str(error[0]) == "dockerd went away"
    assert runtime.engine is None  # the next start asks dockerd's version again


def test_interrupt_and_close_cut_a_blocked_wait_promptly(dockerd: FakeDockerd) -> None:
    dockerd.images.add(IMAGE)
    image = [IMAGE]
    runtime = docker_runtime(dockerd, lambda: ContainerSpec("vbar", image[0]))
    runtime.start()
    thread, result, _ = waiting(runtime)
    wait_until(lambda: len(dockerd.subscribers) == 1)
    assert runtime.interrupt() is False  # same spec: the wait goes on
    time.sleep(0.1)
    assert thread.is_alive()

    # The fake sends no event until die(): a wait that the cut did not end would wait forever, so
    # its end within the generous join proves the cut, with no claim on how long it took.
    image[0] = "example.invalid/vbar:2"  # tpu-env names another image
    assert runtime.interrupt() is True
    thread.join(30)
    assert not thread.is_alive() and result == [None]
    assert dockerd.subscribers[0].closed_by_client.wait(30)

    dockerd.images.add(image[0])
    runtime.start()
    thread, result, _ = waiting(runtime)
    wait_until(lambda: len(dockerd.subscribers) == 2)
    runtime.close()
    thread.join(30)
    assert not thread.is_alive() and result == [None]
    assert dockerd.subscribers[1].closed_by_client.wait(30)
    assert dockerd.running("vbar")  # closing leaves the container running
    assert runtime.wait() is None
    with pytest.raises(RuntimeUnavailable, match="stopping"):
        runtime.start()


def test_supervisor_over_docker_restarts_after_die_and_recovers_from_dockerd_restart(
    dockerd: FakeDockerd,
) -> None:
    dockerd.images.add(IMAGE)
    image = [IMAGE]
    status = Statuses()
    runtime = docker_runtime(dockerd, lambda: ContainerSpec("vbar", image[0]))
    fast = RestartPolicy(initial=0.05, maximum=0.2, stable_after=30.0)  # its own: a policy counts exits
    supervisor = Supervisor("vBar", runtime, fast, status)
    supervisor.start()
    try:
        wait_until(lambda: status.last == "vBar: running" and len(dockerd.subscribers) == 1)
        first = dockerd.containers["vbar"]["Id"]
        dockerd.die("vbar", 1)
        wait_until(lambda: status.last == "vBar: running" and len(dockerd.subscribers) == 2)
        assert supervisor.starts == 2 and dockerd.containers["vbar"]["Id"] == first  # restarted in place

        dockerd.stop()
        wait_until(lambda: "waiting" in status.last)
        dockerd.stale_tasks.add(first)  # containerd kept the stopped container's task
        dockerd.start()
        wait_until(lambda: status.last == "vBar: running" and len(dockerd.subscribers) == 3, timeout=15)
        assert dockerd.running("vbar") and dockerd.containers["vbar"]["Id"] != first  # made anew

        image[0] = "example.invalid/vbar:2"
        dockerd.images.add(image[0])
        supervisor.reconfigure()
        wait_until(lambda: dockerd.image_of("vbar") == image[0])
        wait_until(lambda: status.last == "vBar: running")
    finally:
        supervisor.stop()
    assert dockerd.running("vbar")  # stopping tpuboot leaves it running


def test_containers_find_dockerd_under_the_root(dockerd: FakeDockerd) -> None:
    """The daemon's default client: the socket at /run/docker.sock under the root."""
    config = Config(gke="false")
    dockerd.images.add(config.vbar.image)
    containers = Containers(config, Root(dockerd.root), None)
    containers.tpu_vm_seen("a TPU is present")
    reports = threading.Semaphore(0)
    containers.start(reports.release)
    try:
        wait_until(lambda: containers.statuses()["vBar"] == Status("running", "running"))
        assert reports.acquire(timeout=30)  # each change reported
        assert containers.status() == Status("running", "vBar: running")
    finally:
        containers.stop()
    assert dockerd.containers[config.vbar.container_name]["Config"]["Image"] == config.vbar.image


def test_the_doctor_asks_dockerd_whether_the_container_runs(dockerd: FakeDockerd, tmp_path: Path) -> None:
    root = Root(dockerd.root)
    assert engine_container_state(root, "vbar") == "absent"
    dockerd.add_container("vbar", IMAGE)
    assert engine_container_state(root, "vbar") == "running"
    dockerd.die("vbar", 1)
    assert engine_container_state(root, "vbar") == "exited (exit code 1)"
    dockerd.stop()
    with pytest.raises(Unreachable):
        engine_container_state(root, "vbar")
    with pytest.raises(Unreachable):
        engine_container_state(Root(tmp_path), "vbar")


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("vbar", ("vbar", "latest")),
        ("vbar:1", ("vbar", "1")),
        ("gcr.io/p/vbar:0.0.1", ("gcr.io/p/vbar", "0.0.1")),
        ("localhost:5000/vbar", ("localhost:5000/vbar", "latest")),
        ("host:5000/img:tag", ("host:5000/img", "tag")),
        ("host:5000/a/b/img", ("host:5000/a/b/img", "latest")),
        ("img@sha256:" + "a" * 64, ("img", "sha256:" + "a" * 64)),
        ("host:5000/img@sha256:" + "b" * 64, ("host:5000/img", "sha256:" + "b" * 64)),
        ("host:5000/img:2@sha256:" + "c" * 64, ("host:5000/img", "sha256:" + "c" * 64)),
    ],
)
def test_split_image(image: str, parts: tuple[str, str]) -> None:
    assert split_image(image) == parts


# --- the telemetry collector's configuration -------------------------------------------------


def test_the_collector_gets_its_config_file_read_only_where_it_is_told(root: Root) -> None:
    root.path("/etc/tpuboot").mkdir(parents=True, exist_ok=True)
    root.path("/etc/tpuboot/collector.yaml").write_text("interval: 30s\n")
    config = TelemetryConfig(
        enabled=True, config_path="/etc/tpuboot/collector.yaml", config_target="/etc/collector/config.yaml"
    )
    first = telemetry_spec(config, root)
    assert first.binds == (("/etc/tpuboot/collector.yaml", "/etc/collector/config.yaml"),)
    assert not first.problem and first.content
    same = telemetry_spec(config.replace(config_target=None), root)
    assert same.binds == (("/etc/tpuboot/collector.yaml", "/etc/tpuboot/collector.yaml"),)
    # An edited file is another container: a bound file stays the old inode inside.
    root.path("/etc/tpuboot/collector.yaml").write_text("interval: 60s\n")
    edited = telemetry_spec(config, root)
    assert edited != first and edited.config_hash != first.config_hash
    # Without a file, no bind and the hash of a container made before this field (still adopted).
    plain = telemetry_spec(TelemetryConfig(enabled=True), root)
    assert plain.binds == () and plain.config_hash == ContainerSpec(plain.name, plain.image).config_hash


def test_a_missing_config_file_is_never_bound_and_the_status_says_how_to_fix_it(
    root: Root, dockerd: FakeDockerd
) -> None:
    config = TelemetryConfig(enabled=True, image=IMAGE, config_path="/etc/tpuboot/collector.yaml")
    spec = telemetry_spec(config, root)
    assert spec.problem == (
        "telemetry.config_path /etc/tpuboot/collector.yaml: no such file; "
        "create it or unset telemetry.config_path"
    )
    dockerd.images.add(IMAGE)
    with pytest.raises(CannotStart, match="no such file"):
        docker_runtime(dockerd, lambda: spec).start()
    assert dockerd.calls("POST", "/containers/create") == []  # dockerd would make a directory there
    root.path("/etc/tpuboot/collector.yaml").mkdir(parents=True)
    assert "not a regular file" in telemetry_spec(config, root).problem
