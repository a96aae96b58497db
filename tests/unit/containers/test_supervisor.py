"""The supervisor loop over the exec runtime (a stand-in binary); the containers in the daemon.

The docker runtime is tested against a fake dockerd in test_service.py.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.polling import wait_until
from tests.unit.helpers.containers import Statuses
from tests.unit.helpers.daemon import after_boot_part, guest_attribute_values, serving, until
from tests.unit.helpers.runproc import free_port
from tpuboot import metrics, metrics_export
from tpuboot.backoff import RestartPolicy
from tpuboot.config import Config, MetadataConfig, TelemetryConfig, VbarConfig
from tpuboot.containers.agents import VBAR_AGENT
from tpuboot.containers.exec import ExecRuntime, describe_exit
from tpuboot.containers.gke import gke_node
from tpuboot.containers.service import Containers
from tpuboot.containers.supervisor import Supervisor
from tpuboot.endpoints import Endpoint
from tpuboot.env.tpuenv import parse_env_file, render_env_file
from tpuboot.paths import Root


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
        registry = metrics_export.registry_of(counted)
        supervisor.start()
        wait_until(lambda: len((tmp_path / "runs").read_text() if (tmp_path / "runs").exists() else "") >= 5)
        # The fifth child wrote before it exited: its exit, and the delay after it, come later
        # (on a loaded machine, after stop() had the test not waited for them).
        wait_until(lambda: len(supervisor.delays) >= 5 and "crash loop" in status.last)
        supervisor.stop()
    assert list(supervisor.delays)[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
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


def test_a_supervisor_keeps_only_the_last_restart_delays(tmp_path: Path) -> None:
    """A daemon lives for months and its containers restart without end: what it keeps of each
    restart is bounded (every delay was kept, one more per vBar kill: issue 38)."""
    from tpuboot.containers.supervisor import RECENT_DELAYS

    status = Statuses()
    at_once = RestartPolicy(initial=0.0, maximum=0.0, stable_after=30.0)
    supervisor = Supervisor("vBar", ExecRuntime([str(tmp_path / "absent")]), at_once, status)
    with metrics.use(metrics.Metrics()) as counted:
        registry = metrics_export.registry_of(counted)

        def restarts() -> float:
            return registry.get_sample_value("tpuboot_container_restarts_total", {"container": "vBar"}) or 0.0

        supervisor.start()
        wait_until(lambda: restarts() > 2 * RECENT_DELAYS)
        supervisor.stop()
    assert len(supervisor.delays) == RECENT_DELAYS < restarts()


def test_describe_exit() -> None:
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-9) == "killed by SIGKILL"


# --------------------------------------------------------------------------- helpers


def test_the_tpu_env_file_reads_back_every_value() -> None:
    values = {"A": "gcr.io/x/y:1", "B": "", "C": 'q"$`\\ \nz', "D": "a,b"}
    assert parse_env_file(render_env_file(values)) == values


# --------------------------------------------------------------------------- in the daemon


def daemon_with(kernel: Any, root: Any, engine: Callable[[], Any] | None = None, **config: Any) -> Any:
    """The daemon as `tpuboot run` builds it, with the containers of ``config`` (Config fields)."""
    from tests.unit.helpers.daemon import DEVICES_ONLY, make

    daemon, _, _ = make(
        kernel, config=DEVICES_ONLY.replace(**{"vbar": VbarConfig(), **config}), root=root, engine=engine
    )
    return daemon


@pytest.fixture
def kernel(tmp_path: Path) -> Any:
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.devices import V5P, add_tpu

    k = FakeKernel(tmp_path / "kernel")
    add_tpu(k, "0000:00:04.0", V5P, driver=None, group="4")
    return k


def test_ready_never_waits_for_dockerd_and_the_status_says_so(kernel: Any, root: Any) -> None:
    """No dockerd installed (none under the root, no /run/docker.sock): STATUS says what vBar
    waits for and how to get it, as doctor's fix does, not "starting" for good."""
    daemon = daemon_with(kernel, root, gke="false")
    with serving(daemon) as running:
        until(lambda: daemon.ready)
        until(lambda: "vBar: waiting (dockerd is not installed" in daemon.notifier.last_status)
        assert daemon.notifier.last_status == (
            "1 TPU bound to vfio-pci; vBar: waiting (dockerd is not installed: apt install docker.io)"
        )
        assert guest_attribute_values(daemon)["vbar"].startswith("waiting (dockerd is not installed")
        running.stop()


@pytest.mark.parametrize("where", ["usr/sbin/dockerd", "usr/bin/dockerd"])
def test_an_installed_dockerd_that_does_not_answer_is_waited_for(kernel: Any, root: Any, where: str) -> None:
    dockerd = root.path("/" + where)
    dockerd.parent.mkdir(parents=True, exist_ok=True)
    dockerd.write_text("#!/bin/sh\n")
    daemon = daemon_with(kernel, root, gke="false")
    with serving(daemon) as running:
        until(lambda: "vBar: waiting (" in daemon.notifier.last_status)
        assert daemon.notifier.last_status.endswith(
            "vBar: waiting (dockerd not answering on /run/docker.sock)"
        )
        running.stop()


def test_while_the_gke_question_is_unanswered_status_says_so(kernel: Any, root: Any) -> None:
    """gke: auto asks until the metadata server answers (vBar must not start on a GKE node): the
    question shows in STATUS, then why it is asked again, and vBar starts once it is answered."""
    from harness.mds_emulator import MetadataEmulator
    from tests.unit.helpers.daemon import DEVICES_ONLY, make
    from tests.unit.helpers.metadata import make_client

    with MetadataEmulator({}) as emu:
        emu.set_faults(status=503)
        config = DEVICES_ONLY.replace(
            vbar=VbarConfig(), gke="auto", metadata=MetadataConfig(boot_deadline=1.0)
        )
        daemon, _, _ = make(kernel, config=config, root=root, metadata=make_client(emu, timeout=0.5))
        with serving(daemon) as running:
            asking = "1 TPU bound to vfio-pci; vBar: not started, asking whether this is a GKE node"
            until(lambda: daemon.notifier.last_status.startswith(asking))
            until(
                lambda: daemon.notifier.last_status.startswith(
                    asking + " (the metadata server did not answer"
                )
            )
            emu.set_faults()
            until(lambda: "vBar: waiting (dockerd is not installed" in daemon.notifier.last_status)
            running.stop()


def test_on_a_gke_node_neither_container_starts(kernel: Any, root: Any) -> None:
    def never() -> Any:
        raise AssertionError("docker must not be used on GKE")

    daemon = daemon_with(kernel, root, never, gke="true", telemetry=TelemetryConfig(enabled=True))
    with serving(daemon) as running:
        until(lambda: "telemetry: not started" in daemon.notifier.last_status)
        assert daemon.status_line().endswith(
            "vBar: not started, GKE node (GKE runs it); "
            "telemetry: not started, GKE node (GKE runs the telemetry collector)"
        )
        assert {s.state for s in daemon.part(Containers).statuses().values()} == {"not started"}
        running.stop()


class FakeMetadata:
    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.asked: list[str] = []

    def get(self, path: str, *, deadline_s: float) -> object:
        from tpuboot.gce.replies import MetadataAbsent

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


def test_exec_runtime_from_config_and_stop_ends_the_child(
    kernel: Any, root: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in listens on vBar's endpoint as the agent does, so the daemon's probe of it (at a
    tick, which may come at any moment of the start) leaves the status at ``running``."""
    from tpuboot import daemon as daemon_module

    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(daemon_module, "TICK_INTERVAL", 0.05)
    port = free_port()
    argv = stand_in(
        tmp_path,
        "import socket\n"
        f"server = socket.create_server(('127.0.0.1', {port}))\n"
        "open(sys.argv[1] + '/up', 'w').close()\n"
        "time.sleep(60)\n",
    )
    vbar = VbarConfig(runtime="exec", exec_argv=tuple(argv), endpoint=Endpoint(host="127.0.0.1", port=port))
    daemon = daemon_with(kernel, root, gke="false", vbar=vbar)

    def sample(name: str) -> float | None:
        return metrics_export.registry_of(fresh).get_sample_value(name, {"container": "vBar"})

    with metrics.use(metrics.Metrics()) as fresh, serving(daemon) as running:
        until(lambda: sample("tpuboot_container_endpoint_up") == 1.0, timeout=20)
        assert daemon.status_line().endswith("vBar: running")
        assert sample("tpuboot_container_up") == 1.0
        running.stop()
    runtime = daemon.part(Containers).supervisors["vBar"].runtime
    assert isinstance(runtime, ExecRuntime) and runtime.proc is not None
    assert runtime.proc.returncode == -signal.SIGTERM


def test_vbar_image_comes_from_tpu_env_else_the_config(tmp_path: Path) -> None:
    config, root = Config(), Root(tmp_path)
    assert VBAR_AGENT.container(config, root, None).image == config.vbar.image
    assert VBAR_AGENT.container(config, root, {"VBARCONTROL_AGENT_DOCKER_URL": ""}).image == config.vbar.image
    wanted = VBAR_AGENT.container(config, root, {"A": "1", "VBARCONTROL_AGENT_DOCKER_URL": "local/vbar:2"})
    assert (wanted.name, wanted.image) == (config.vbar.container_name, "local/vbar:2")
    assert wanted.origin == "tpu-env's VBARCONTROL_AGENT_DOCKER_URL"


def test_on_an_image_building_vm_nothing_privileged_starts_until_a_tpu_appears(
    tmp_path: Path, root: Any
) -> None:
    """No TPU and no tpu-env (a VM building an image): vBar is not started and dockerd is never
    asked, so nothing is pulled into the image; a TPU hot-added later starts it."""
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.devices import V5P, add_tpu

    asked = threading.Event()

    def docker() -> Any:
        asked.set()
        raise ConnectionRefusedError("no dockerd here")

    kernel = FakeKernel(tmp_path / "kernel")
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")  # a boot disk

    daemon = daemon_with(kernel, root, docker, gke="false")
    with serving(daemon) as running:
        until(lambda: daemon.ready and "vBar: not started" in daemon.status_line())
        assert daemon.status_line() == (
            "no TPUs found; vBar: not started, not a TPU VM (no TPU present, no tpu-env)"
        )
        time.sleep(0.3)  # a moment in which nothing may ask dockerd (no event can show it never does)
        assert not asked.is_set()
        add_tpu(kernel, "0000:00:04.0", V5P, driver=None, group="4")
        daemon.devices.monitor.push("add", "pci", "0000:00:04.0")
        until(asked.is_set)
        until(lambda: "vBar: waiting" in daemon.status_line())
        running.stop()


@pytest.mark.parametrize("held", [True, False], ids=["tpu-env held", "tpu-env absent"])
def test_tpu_env_alone_makes_it_a_tpu_vm(tmp_path: Path, root: Any, emulator: Any, held: bool) -> None:
    """tpu-env held (from metadata or the cache) counts as a TPU VM before any TPU shows; an absent
    tpu-env does not."""
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.daemon import make, with_env
    from tests.unit.helpers.metadata import make_client

    if not held:
        emulator.set_attribute("tpu-env", None)

    def docker() -> Any:
        raise ConnectionRefusedError("no dockerd here")

    kernel = FakeKernel(tmp_path / "kernel")  # no TPU
    config = with_env(emulator).replace(vbar=VbarConfig(), gke="false")

    daemon, _, _ = make(kernel, config=config, root=root, metadata=make_client(emulator), engine=docker)

    with serving(daemon) as running:
        containers = after_boot_part(daemon, Containers)  # made right after READY
        if held:  # the supervisor starts (the sample's image is then refused: not in vbar.registries)
            until(lambda: "vBar" in containers.supervisors)
        else:
            until(lambda: "vBar: not started, not a TPU VM" in daemon.status_line())
            time.sleep(0.2)  # a moment in which the gate may not open
        assert ("vBar" in containers.supervisors) is held  # the gate opened, or stayed shut
        running.stop()
