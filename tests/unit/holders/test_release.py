"""`tpuboot release` and `wait-free`: unheld lock files removed whoever owns them and held ones
kept, holders ended only with --kill and never tpuboot, PID 1 or vBar's, a reused PID never
signalled (real child processes on this host), and waiting until free or the timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.fakes.proc import FakeProc
from tests.unit.helpers.devices import add_chips
from tests.unit.helpers.holders import DOCKER_ID, chips
from tpuboot import cli, metrics, metrics_export
from tpuboot.config import Config, DoctorConfig, VbarConfig, parse_config
from tpuboot.containers.engine import MANAGED_LABEL, EngineUnreachable
from tpuboot.errors import ConfigError
from tpuboot.holders.procfs import Process, ProcReader
from tpuboot.holders.release import end, protected, release, remove_unheld
from tpuboot.holders.report import Report, gather, render
from tpuboot.holders.supervised import Supervised, supervised
from tpuboot.holders.wait import wait_free
from tpuboot.paths import Root

HOST = Root("/")


@pytest.fixture
def tree(tmp_path: Path) -> tuple[FakeKernel, FakeProc]:
    kernel = FakeKernel(tmp_path)
    (tmp_path / "tmp").mkdir()
    return kernel, FakeProc(tmp_path)


def test_release_removes_unheld_lock_files_and_keeps_held_ones(tree):
    kernel, proc = tree
    tmp = kernel.top / "tmp"
    held, loose = tmp / "libtpu_lockfile", tmp / "libtpu_lockfile_1001"
    held.write_text("")
    loose.write_text("")
    proc.add(100, {3: "/tmp/libtpu_lockfile"})
    proc.lock(100, held)
    report = gather(kernel.root, [])
    dry = release(kernel.root, report, Supervised(), dry_run=True, kill=False)
    assert dry[0].startswith("kept /tmp/libtpu_lockfile: held by PID 100")
    assert dry[1] == "would remove /tmp/libtpu_lockfile_1001 (owner " + report.locks[1].owner + ", not held)"
    assert loose.exists()
    lines = release(kernel.root, report, Supervised(), dry_run=False, kill=False)
    assert lines[1].startswith("removed /tmp/libtpu_lockfile_1001") and not loose.exists() and held.exists()
    assert lines[2].startswith("holder: PID 100") and lines[2].endswith("(--kill ends it)")


def test_a_lock_taken_since_the_scan_is_not_removed(tree):
    """The scan said nobody held it; a libtpu locked it since: release holds the lock to unlink."""
    kernel, _ = tree
    path = kernel.top / "tmp/libtpu_lockfile"
    path.write_text("")
    (lock,) = gather(kernel.root, []).locks
    child = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1],'r+'); fcntl.lockf(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "locked\n"
        outcome = remove_unheld(kernel.root, lock, dry_run=False)
        assert outcome == "kept /tmp/libtpu_lockfile: locked since the scan"
        assert path.exists()
    finally:
        child.communicate("")
    assert remove_unheld(kernel.root, lock, dry_run=False).startswith("removed")


OFD_HOLDER = "a process /proc/locks cannot name (an open file description lock)"


def test_a_lock_held_through_an_open_file_description_is_kept_and_said_so(tree):
    """/proc/locks names no PID for an OFD lock: release keeps the file and never says 'PID None'."""
    kernel, proc = tree
    path = kernel.top / "tmp/libtpu_lockfile"
    path.write_text("")
    proc.lock(-1, path, kind="OFDLCK")
    report = gather(kernel.root, [])
    (line,) = release(kernel.root, report, Supervised(), dry_run=False, kill=False)
    assert line == f"kept /tmp/libtpu_lockfile: held by {OFD_HOLDER}" and path.exists()
    assert render(report)[-1].endswith(f"held by {OFD_HOLDER}")


def test_a_holder_of_the_vfio_container_alone_is_never_ended(tree):
    """/dev/vfio/vfio is every VFIO user's, a VM's passthrough device too: not a TPU holder."""
    kernel, proc = tree
    add_chips(kernel, ["12"])
    kernel.add_device("0000:00:1f.0", 0x8086, 0x1572, driver="vfio-pci", group="40")  # a NIC, passed through
    proc.add(100, {3: "/dev/vfio/vfio", 4: "/dev/vfio/40"}, cmdline=["qemu-system-x86_64"])
    proc.add(101, {3: "/dev/vfio/vfio", 4: "/dev/vfio/12"})
    lines = release(kernel.root, gather(kernel.root, chips(kernel)), Supervised(), dry_run=True, kill=True)
    assert lines == [
        "left alone: PID 100 (root, sleeping, started 2025-12-01T00:00:10Z, unit train.service): "
        "qemu-system-x86_64 (it holds /dev/vfio/vfio only, which users of other VFIO devices open too)",
        "would end: PID 101 (root, sleeping, started 2025-12-01T00:00:10Z, unit train.service): "
        "python3 train.py",
    ]


def test_kill_is_refused_under_a_root_tree(tree, capsys):
    kernel, _ = tree
    assert cli.main(["--root", str(kernel.top), "release", "--kill"]) == 2
    assert "--kill ends processes of this host only" in capsys.readouterr().err


def test_release_exits_by_what_is_still_held(tree, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    (kernel.top / "tmp/libtpu_lockfile").write_text("")
    assert cli.main(["--root", str(kernel.top), "release"]) == 0
    assert "removed /tmp/libtpu_lockfile" in capsys.readouterr().out
    proc.add(100, {4: "/dev/vfio/12"})
    assert cli.main(["--root", str(kernel.top), "release", "--dry-run", "--kill"]) == 1
    assert "would end: PID 100" in capsys.readouterr().out


def fake(pid: int, command: str = "python3 train.py", **kw: object) -> Process:
    base = Process(pid, 1, 0, "root", command, "sleeping", None, 0, None, None, None, None, None)
    return replace(base, **kw)  # type: ignore[arg-type]


def test_tpuboot_pid_1_and_the_agents_are_never_ended():
    agents = Supervised(containers=lambda: {DOCKER_ID: "vbar"})
    assert protected(fake(os.getpid()), agents) == "tpuboot itself"
    assert protected(fake(1), agents) == "PID 1"
    assert protected(fake(50, "/usr/bin/python3 /usr/bin/tpuboot run"), agents) == "tpuboot"
    assert protected(fake(50, "python3 -m tpuboot who"), agents) == "tpuboot"
    assert protected(fake(50, "/usr/bin/tpuboot-helper x"), agents) is None
    vbars = fake(51, container=DOCKER_ID, engine="docker")
    assert protected(vbars, agents) == f"tpuboot's container vbar ({DOCKER_ID[:12]})"
    assert protected(fake(52, container="cd" * 32, engine="docker"), agents) is None
    assert protected(fake(52, container=DOCKER_ID, engine="podman"), agents) is None  # not the host engine's
    exec_vbar = Supervised({"/usr/bin/vbar_control_agent": "vBar"})
    assert protected(fake(53, "/usr/bin/vbar_control_agent --port 8353"), exec_vbar).startswith("vBar (")
    assert protected(fake(53, container=DOCKER_ID, engine="docker"), exec_vbar) is None  # no agent in one


def test_an_engine_that_cannot_say_spares_every_process_in_its_containers_and_is_asked_once():
    asked = []

    def refused() -> dict[str, str]:
        asked.append(1)
        raise EngineUnreachable("refused")

    unknown = Supervised(containers=refused)
    assert protected(fake(55), unknown) is None
    assert asked == []  # not a container's: the engine is not asked
    other = fake(54, container="cd" * 32, engine="docker")
    assert protected(other, unknown) == (
        "in a docker container, and dockerd does not say which containers are tpuboot's (refused)"
    )
    assert protected(other, unknown) is not None and asked == [1]


def test_what_the_engine_names_is_printed_escaped():
    agents = Supervised(containers=lambda: {DOCKER_ID: "vbar\x1b[2J\nPID 1"})
    reason = protected(fake(51, container=DOCKER_ID, engine="docker"), agents) or ""
    assert "\x1b" not in reason and "\n" not in reason and reason.startswith("tpuboot's container vbar")


def test_the_agents_by_runtime(tmp_path):
    root = Root(tmp_path)
    off = Config(vbar=VbarConfig(enabled=False))
    assert supervised(root, off).programs == {} and supervised(root, off)._list is None
    exec_config = Config(vbar=VbarConfig(runtime="exec"))
    assert supervised(root, exec_config).programs == {exec_config.vbar.exec_argv[0]: "vBar"}
    in_docker = fake(51, container=DOCKER_ID, engine="docker")
    assert supervised(root, exec_config).reason(in_docker) is None  # no agent in a container: not asked
    assert supervised(root, Config()).reason(in_docker) is None  # no dockerd socket: no container of it


def test_every_container_tpuboot_made_is_an_agents_whatever_its_name():
    from tests.unit.fakes.dockerd import fake_dockerd

    with fake_dockerd() as dockerd:
        root = Root(dockerd.root)
        theirs = dockerd.add_container("vbar", "example.invalid/vbar:1")  # the user's, not labelled
        ours = dockerd.add_container("collector-7", "example.invalid/c:1", labels={MANAGED_LABEL: "1"})
        agents = supervised(root, Config())
        assert agents.reason(fake(60, container=theirs, engine="docker")) is None
        assert agents.reason(fake(61, container=ours, engine="docker")) == (
            f"tpuboot's container collector-7 ({ours[:12]})"
        )


def child(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv) or ["sleep", "600"], stdin=subprocess.DEVNULL)


def read(pid: int) -> Process:
    p = ProcReader(HOST).process(pid)
    assert p is not None
    return p


def test_end_terms_a_holder_and_a_stopped_one():
    for stop in (False, True):
        proc = child()
        try:
            if stop:
                os.kill(proc.pid, signal.SIGSTOP)
            p = read(proc.pid)
            assert end(HOST, p) == f"PID {proc.pid} ended on SIGTERM"
            assert proc.wait(30) == -signal.SIGTERM
        finally:
            proc.kill()
            proc.wait()


def test_end_kills_one_that_ignores_sigterm():
    script = "trap '' TERM; echo ready; while :; do sleep 1; done"
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # the trap is set
        p = read(proc.pid)
        assert end(HOST, p, grace=0.3) == f"PID {proc.pid} ended on SIGKILL after 0.3 s"
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_whose_start_time_changed_is_left_alone():
    proc = child()
    try:
        p = replace(read(proc.pid), start_ticks=read(proc.pid).start_ticks + 1)
        assert "its PID was reused" in end(HOST, p)
        assert proc.poll() is None  # not signalled
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_is_not_signalled_and_its_parent_is_named():
    outcome = end(HOST, fake(4242, state="zombie", ppid=77))
    assert outcome.endswith("its parent, PID 77, must reap it (end or restart the parent)")


def test_end_without_pidfds_checks_the_start_time(monkeypatch):
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    proc = child()
    try:
        assert end(HOST, read(proc.pid)) == f"PID {proc.pid} ended on SIGTERM"
    finally:
        proc.kill()
        proc.wait()


# --- wait-free -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def held(free: bool) -> Report:
    from tpuboot.holders.locks import LIBTPU_LOCKFILE, LockFile

    return Report([], (), [] if free else [LockFile(LIBTPU_LOCKFILE, 0, "root", "0600", True, 9, None)])


def test_wait_free_returns_once_free_polling_at_its_interval():
    clock = Clock()
    answers = iter([held(False), held(False), held(True)])
    report = wait_free(lambda: next(answers), 10, 1.0, lambda: clock.now, clock.sleep)
    assert report.free and clock.slept == [1.0, 1.0]


def test_wait_free_gives_up_at_the_timeout_with_the_holders():
    clock = Clock()
    report = wait_free(lambda: held(False), 2.5, 1.0, lambda: clock.now, clock.sleep)
    assert not report.free and clock.slept == [1.0, 1.0, 0.5]


def test_wait_free_command(tree, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    assert cli.main(["--root", str(kernel.top), "wait-free", "--timeout", "1"]) == 0
    proc.add(100, {4: "/dev/vfio/12"})
    assert cli.main(["--root", str(kernel.top), "wait-free", "--timeout", "0.2"]) == 1
    err = capsys.readouterr().err
    assert "still held, or not every process seen, after 0.2 s:" in err and "PID 100" in err


# --- metrics and configuration --------------------------------------------------------------------


def test_holder_metrics_per_chip_and_state_and_lock(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    lock = kernel.top / "tmp/libtpu_lockfile"
    lock.write_text("")
    proc.add(100, {4: "/dev/vfio/12"}, state="T")
    proc.add(101, {4: "/dev/vfio/12"})
    proc.lock(101, lock)
    with metrics.use(metrics.Metrics()) as m:
        report = gather(kernel.root, chips(kernel))
        metrics.holders(report.holder_counts(), report.lock_states())
        value = metrics_export.registry_of(m).get_sample_value
        assert value("tpuboot_chip_holders", {"chip": "0000:00:04", "state": "stopped"}) == 1
        assert value("tpuboot_chip_holders", {"chip": "0000:00:04", "state": "sleeping"}) == 1
        assert value("tpuboot_chip_holders", {"chip": "0000:00:05", "state": "running"}) == 0
        assert value("tpuboot_libtpu_lock_held", {"path": "/tmp/libtpu_lockfile"}) == 1
        proc.remove(100)
        lock.unlink()
        report = gather(kernel.root, chips(kernel))
        metrics.holders(report.holder_counts(), report.lock_states())
        assert value("tpuboot_chip_holders", {"chip": "0000:00:04", "state": "stopped"}) == 0
        assert value("tpuboot_libtpu_lock_held", {"path": "/tmp/libtpu_lockfile"}) is None


def test_job_units_are_unit_names():
    assert parse_config("doctor: {job_units: [train.service, x.scope]}\n", "f").doctor == DoctorConfig(
        job_units=("train.service", "x.scope")
    )
    for bad in ("train", "/etc/x.service", "[1]", "train.service"):
        with pytest.raises(ConfigError, match=r"doctor\.job_units"):
            parse_config(f"doctor: {{job_units: {bad}}}\n", "f")
