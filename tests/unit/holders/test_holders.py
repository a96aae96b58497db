"""Who holds the TPU, on fake /proc trees of many shapes: chips and their holders (by link text,
deleted nodes, group numbers of any length, two functions per chip), processes that vanish or
cannot be read, other PID namespaces and containers, libtpu's lock files and their holders, the
`who` command, and the doctor's checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.fakes.proc import BOOT, TICKS, FakeProc, device
from tests.unit.helpers.devices import TPU7X, add_chips
from tests.unit.helpers.holders import DOCKER_ID, chips, refuse_fds
from tests.unit.helpers.images import NoSystemctl
from tpuboot import cli, metrics_export
from tpuboot.checks import holders as holder_checks
from tpuboot.checks.holders import HolderChecks
from tpuboot.config import Config, DoctorConfig
from tpuboot.devices.chips import ChipFunction, group_chips
from tpuboot.devices.table import DeviceTable
from tpuboot.holders import scan as scan_module
from tpuboot.holders.locks import LIBTPU_LOCKFILE, lock_paths, lock_table
from tpuboot.holders.procfs import ProcReader, where_from_cgroup
from tpuboot.holders.report import gather, render, summary
from tpuboot.holders.scan import scan
from tpuboot.holders.supervised import Supervised
from tpuboot.holders.targets import targets


@pytest.fixture
def tree(tmp_path: Path) -> tuple[FakeKernel, FakeProc]:
    kernel = FakeKernel(tmp_path)
    (tmp_path / "tmp").mkdir()
    return kernel, FakeProc(tmp_path)


def holder_pids(report) -> list[list[int]]:
    return [[h.process.pid for h in c.holders] for c in report.chips]


# --- the scan ------------------------------------------------------------------------------------


def test_a_holder_of_a_chip_and_the_container_is_named_with_its_facts(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.user(1001, "alice")
    fds = {3: "/dev/vfio/vfio", 4: "/dev/vfio/12", 5: "pipe:[123]", 6: "/home/alice/x"}
    proc.add(100, fds, uid=1001, start=500)
    proc.add(101, {3: "/dev/null", 4: "socket:[9]"})
    report = gather(kernel.root, chips(kernel))
    assert holder_pids(report) == [[100], []]
    assert [h.process.pid for h in report.vfio_container] == [100]
    holder = report.chips[0].holders[0]
    assert holder.nodes == ("/dev/vfio/12",)
    p = holder.process
    assert (p.user, p.state, p.command) == ("alice", "sleeping", "python3 train.py")
    assert (p.unit, p.container) == ("train.service", None)
    assert p.started == BOOT + 500 / TICKS
    assert not report.free
    assert summary(report.chips[1]) == "free"
    text = "\n".join(render(report))
    assert "chip 0  TPU v5p  /dev/vfio/12" in text and "PID 100 (alice, sleeping" in text
    assert "unit train.service" in text and "no libtpu lock file" in text


def test_a_deleted_node_still_held_counts(tree):
    """After an unbind the node is gone, and the holder's link says so: it holds the chip still."""
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(100, {4: "/dev/vfio/12 (deleted)"})
    proc.add(101, {4: "/tmp/scratch (deleted)"})
    assert holder_pids(gather(kernel.root, chips(kernel))) == [[100]]


def test_group_numbers_of_any_length_are_told_apart(tree):
    kernel, proc = tree
    add_chips(kernel, ["7", "71", "712", "10024"])
    proc.add(100, {4: "/dev/vfio/71"})
    proc.add(101, {4: "/dev/vfio/10024", 5: "/dev/vfio/7"})
    proc.add(102, {4: "/dev/vfio/7123"})  # no such chip: someone else's group
    assert holder_pids(gather(kernel.root, chips(kernel))) == [[101], [100], [], [101]]


def test_two_functions_per_chip_are_one_chip_held_through_either_group(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13", "14", "15"], TPU7X, per_chip=2)
    proc.add(100, {4: "/dev/vfio/13"})
    report = gather(kernel.root, chips(kernel))
    assert [(c.chip.index, c.chip.nodes) for c in report.chips] == [
        (0, ("/dev/vfio/12", "/dev/vfio/13")),
        (1, ("/dev/vfio/14", "/dev/vfio/15")),
    ]
    assert holder_pids(report) == [[100], []]


def test_accel_chips_are_matched_by_their_accel_nodes():
    table = DeviceTable()
    (chip,) = group_chips([ChipFunction("0000:00:04.0", "TPU v4", None, ("/dev/accel0",))], table)
    assert chip.nodes == ("/dev/accel0",)


def test_a_thousand_processes_of_fifty_files_each(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    for pid in range(1000, 2000):
        fds = {n: f"/home/u/data/{pid}-{n}" for n in range(50)}
        if pid in (1234, 1999):
            fds[51] = "/dev/vfio/13"
        proc.add(pid, fds)
    report = gather(kernel.root, chips(kernel))
    assert holder_pids(report) == [[], [1234, 1999]]


def test_a_process_that_vanishes_mid_scan_is_skipped(tree, monkeypatch):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(100, {4: "/dev/vfio/12"})
    proc.add(101, {4: "/dev/vfio/12"})
    opened: dict[int, str] = {}
    real_open, real_readlink = os.open, os.readlink

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = str(path)
        return fd

    def readlink(path, *, dir_fd=None):
        if dir_fd is not None and opened.get(dir_fd, "").endswith("/101/fd"):
            raise FileNotFoundError(2, "No such file or directory")  # it exited after its fds were listed
        return real_readlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(scan_module.os, "open", open_)
    monkeypatch.setattr(scan_module.os, "readlink", readlink)
    assert holder_pids(gather(kernel.root, chips(kernel))) == [[100]]


def test_a_holder_that_exits_between_the_scan_and_its_facts_is_left_out(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(100, {4: "/dev/vfio/12"})
    opened = scan(kernel.root, targets(kernel.root, chips(kernel)))
    proc.remove(100)
    assert opened.holders_of("/dev/vfio/12") == [100]
    assert ProcReader(kernel.root).process(100) is None


def test_unreadable_fds_are_counted_and_said(tree, monkeypatch):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(100, {4: "/dev/vfio/12"})
    proc.add(200, {4: "/dev/vfio/12"})
    refuse_fds(monkeypatch, 200)
    report = gather(kernel.root, chips(kernel))
    assert holder_pids(report) == [[100]] and report.unseen.unreadable == (200,)
    assert not report.free and report.maybe_held  # PID 200 may hold any chip
    assert (
        "not seen: the open files of 1 process (PID 200) could not be read (run as root to see them);"
        " a chip shown free may be held"
    ) in render(report)


def test_a_holder_in_a_container_and_another_pid_namespace(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    cgroup = f"0::/system.slice/docker-{DOCKER_ID}.scope\n"
    proc.add(100, {4: "/dev/vfio/12"}, cgroup=cgroup, pidns="pid:[4026532999]", nspid=[100, 1])
    (p,) = [h.process for h in gather(kernel.root, chips(kernel)).chips[0].holders]
    assert (p.container, p.engine, p.unit) == (DOCKER_ID, "docker", None)
    assert (p.pid_namespace, p.namespace_pid) == ("pid:[4026532999]", 1)
    assert p.where == f"docker container {DOCKER_ID[:12]}"


def test_who_names_a_holder_that_is_one_of_tpuboots_agents(tree):
    """In the text and the JSON, and only where the agents are asked about (`status` is not)."""
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.add(100, {4: "/dev/vfio/12"}, cgroup=f"0::/system.slice/docker-{DOCKER_ID}.scope\n")
    proc.add(101, {4: "/dev/vfio/13"})
    report = gather(kernel.root, chips(kernel))
    agents = Supervised(containers=lambda: {DOCKER_ID: "vbar"})
    named = f"[tpuboot's container vbar ({DOCKER_ID[:12]}): release --kill spares it]"
    lines = render(report, agents.reason)
    assert [line.endswith(named) for line in lines if "PID 10" in line] == [True, False]
    assert not any(named in line for line in render(report))
    held = [h for c in report.as_dict(agents.reason)["chips"] for h in c["holders"]]  # type: ignore[attr-defined]
    assert [h["tpuboot_agent"] for h in held] == [f"tpuboot's container vbar ({DOCKER_ID[:12]})", None]
    assert "tpuboot_agent" not in report.chips[0].as_dict()["holders"][0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("cgroup", "where"),
    [
        ("0::/user.slice/user-1000.slice/session-3.scope\n", ("session-3.scope", None, None)),
        ("0::/user.slice/user@1000.service/app.slice/run-r1.service\n", ("run-r1.service", None, None)),
        (f"0::/kubepods.slice/cri-containerd-{DOCKER_ID}.scope\n", (None, DOCKER_ID, "containerd")),
        (f"0::/machine.slice/libpod-{DOCKER_ID}.scope/container\n", (None, DOCKER_ID, "podman")),
        (f"0::/machine.slice/libpod-{DOCKER_ID}.scope\n", (None, DOCKER_ID, "podman")),
        (f"12:pids:/docker/{DOCKER_ID}\n0::/\n", (None, DOCKER_ID, "docker")),
        ("0::/\n", (None, None, None)),
    ],
)
def test_where_a_process_runs_from_its_cgroup(cgroup, where):
    assert where_from_cgroup(cgroup) == where


def test_states_of_holders(tree):
    kernel, proc = tree
    add_chips(kernel, ["1", "2", "3", "4", "5"])
    for n, state in enumerate("RTZDt"):
        proc.add(100 + n, {4: f"/dev/vfio/{n + 1}"}, state=state, cmdline=[] if state == "Z" else None)
    report = gather(kernel.root, chips(kernel))
    states = [c.holders[0].process.state for c in report.chips]
    assert states == ["running", "stopped", "zombie", "uninterruptible", "stopped"]
    assert report.chips[2].holders[0].process.command == "[python3]"  # a zombie has no command line


# --- lock files ----------------------------------------------------------------------------------


def test_lock_files_fixed_and_per_user_with_their_holders(tree):
    kernel, proc = tree
    tmp = kernel.top / "tmp"
    fixed = tmp / "libtpu_lockfile"
    fixed.write_text("")
    fixed.chmod(0o600)
    (tmp / "libtpu_alice").mkdir()
    per_user = tmp / "libtpu_alice" / "lockfile"
    per_user.write_text("")
    (tmp / "libtpu_lockfile_1001").write_text("")
    (tmp / "unrelated.lock").write_text("")
    proc.add(100, {3: "/tmp/libtpu_lockfile"})
    proc.lock(100, fixed)
    proc.lock(-1, per_user, kind="OFDLCK")
    with open(kernel.top / "proc/locks", "a") as f:  # a waiter for the fixed file is not a holder
        f.write(f"3: -> POSIX  ADVISORY  WRITE 300 {device(tmp / 'libtpu_lockfile_1001')} 0 EOF\n")
    alice = "/tmp/libtpu_alice/lockfile"
    assert lock_paths(kernel.root) == [LIBTPU_LOCKFILE, alice, "/tmp/libtpu_lockfile_1001"]
    report = gather(kernel.root, [])
    by_path = {lock.path: lock for lock in report.locks}
    fixed_lock = by_path[LIBTPU_LOCKFILE]
    assert (fixed_lock.held, fixed_lock.holder_pid, fixed_lock.mode) == (True, 100, "0600")
    assert fixed_lock.holder is not None and fixed_lock.holder.command == "python3 train.py"
    assert (by_path[alice].held, by_path[alice].holder) == (True, None)
    assert by_path["/tmp/libtpu_lockfile_1001"].held is False
    assert not report.free  # a held lock is something held, with no chip at all
    text = render(report)
    assert any("lock /tmp/libtpu_lockfile_1001" in line and line.endswith("not held") for line in text)


def hold_chip_and_lock(kernel: FakeKernel, proc: FakeProc) -> None:
    """Chip 12 and libtpu's lock file, both held by PID 100 (a job as libtpu leaves it)."""
    add_chips(kernel, ["12"])
    lock = kernel.top / "tmp/libtpu_lockfile"
    lock.write_text("")
    proc.add(100, {3: "/tmp/libtpu_lockfile", 4: "/dev/vfio/12"})
    proc.lock(100, lock)


def test_a_process_holding_a_chip_and_the_lock_is_read_once(tree, monkeypatch):
    """One scan reads each process once, whatever it holds: chip and lock holders are one set."""
    kernel, proc = tree
    hold_chip_and_lock(kernel, proc)
    read: list[int] = []
    original = ProcReader.process

    def counted(self, pid, command=True):
        read.append(pid)
        return original(self, pid, command)

    monkeypatch.setattr(ProcReader, "process", counted)
    report = gather(kernel.root, chips(kernel))
    assert read == [100]
    assert report.locks[0].holder is report.chips[0].holders[0].process


def test_the_lock_table_skips_lines_it_cannot_read(tree):
    kernel, _ = tree
    lines = ["garbage", "1: POSIX ADVISORY WRITE x 00:01:2 0 EOF", "2: FLOCK ADVISORY WRITE 7 00:1a:99 0 EOF"]
    (kernel.top / "proc/locks").write_text("\n".join(lines) + "\n")
    assert lock_table(kernel.root) == {(0, 0x1A, 99): 7}


# --- `tpuboot who` ---------------------------------------------------------------------------------


def test_who_exits_0_when_free_and_1_when_held_with_json(tree, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    root = ["--root", str(kernel.top)]
    assert cli.main([*root, "who"]) == 0
    assert "free" in capsys.readouterr().out
    proc.add(100, {4: "/dev/vfio/12"})
    assert cli.main([*root, "who", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["free"] is False
    assert data["chips"][0]["holders"][0]["pid"] == 100
    assert data["chips"][0]["holders"][0]["started"] == "2025-12-01T00:00:10Z"
    assert data["chips"][0]["functions"] == ["0000:00:04.0"]


def test_status_shows_each_chips_holder(tree, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.add(100, {4: "/dev/vfio/13"}, state="T")
    cli.main(["--root", str(kernel.top), "status"])
    out = capsys.readouterr().out
    assert "chip 0  0000:00:04  TPU v5p      free" in out
    assert "chip 1  0000:00:05  TPU v5p      held by PID 100 (stopped) python3 train.py" in out


# --- doctor ---------------------------------------------------------------------------------------


def checks(kernel: FakeKernel, config: Config | None = None) -> HolderChecks:
    from tpuboot.holders.report import chips_of

    return HolderChecks(
        kernel.root, config or Config(), lambda: chips_of(kernel.root, Config()), NoSystemctl()
    )


@pytest.mark.parametrize(
    ("state", "fix"),
    [("T", "kill -CONT 100"), ("Z", "parent, PID 42"), ("D", "waits in the kernel")],
)
def test_doctor_fails_on_a_chip_held_by_a_stuck_process(tree, state, fix):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(100, {4: "/dev/vfio/12"}, state=state, ppid=42)
    result = checks(kernel).check_chip_holders()
    assert result.status == "FAIL" and "chip 0 held by PID 100" in result.detail and fix in result.fix


def test_doctor_passes_a_chip_in_use_and_free_chips(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    assert checks(kernel).check_chip_holders().detail == "2 chips free"
    proc.add(100, {4: "/dev/vfio/12"}, state="R")
    result = checks(kernel).check_chip_holders()
    assert (result.status, result.detail) == ("PASS", "in use by live processes (chip 0: PID 100)")


def test_doctor_fails_on_an_unheld_lock_of_another_user(tree, monkeypatch):
    kernel, proc = tree
    lock = kernel.top / "tmp/libtpu_lockfile"
    lock.write_text("")
    mine = lock.stat().st_uid
    assert checks(kernel).check_locks().status == "PASS"  # the caller's own: harmless to it
    monkeypatch.setattr(holder_checks.os, "geteuid", lambda: mine + 1)
    result = checks(kernel).check_locks()
    assert result.status == "FAIL" and "is held by nobody" in result.detail
    assert "tpuboot release" in result.fix
    proc.add(100, {})
    proc.lock(100, lock)  # now held, by a process with no chip open
    result = checks(kernel).check_locks()
    assert result.status == "WARN" and "which has no chip open" in result.detail


def test_doctor_passes_a_lock_held_by_the_chips_holder(tree):
    kernel, proc = tree
    hold_chip_and_lock(kernel, proc)
    result = checks(kernel).check_locks()
    assert (result.status, result.detail) == ("PASS", "/tmp/libtpu_lockfile held by PID 100")


def test_doctor_passes_a_lock_whose_holder_proc_locks_cannot_name(tree):
    """An open file description lock names no PID: no WARN of a holder without a chip, no 'None'."""
    kernel, proc = tree
    add_chips(kernel, ["12"])
    lock = kernel.top / "tmp/libtpu_lockfile"
    lock.write_text("")
    proc.lock(-1, lock, kind="OFDLCK")
    result = checks(kernel).check_locks()
    assert (result.status, result.detail) == (
        "PASS",
        "/tmp/libtpu_lockfile held by a process /proc/locks cannot name (an open file description lock)",
    )


def cgroup_procs(top: Path, unit: str, pid: int) -> None:
    d = top / "sys/fs/cgroup/system.slice" / unit
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text(f"{pid}\n{pid + 1}\n")


def test_memlock_fails_where_it_is_limited_and_no_cap_excuses_it(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    assert checks(kernel).check_memlock().status == "SKIP"
    cgroup_procs(kernel.top, "docker.service", 300)
    proc.add(300, {}, cmdline=["/usr/sbin/dockerd"], memlock="8388608", capeff="000001ffffffffff")
    proc.add(100, {4: "/dev/vfio/12"}, memlock="65536", capeff="0000000000004000")  # CAP_IPC_LOCK
    result = checks(kernel).check_memlock()
    assert result.status == "FAIL"
    assert result.detail == (
        "dockerd (PID 300; its containers inherit the limit): "
        "max locked memory 8388608 bytes, no CAP_IPC_LOCK"
    )
    assert "systemctl edit docker.service" in result.fix and "--ulimit memlock=-1:-1" in result.fix


def test_memlock_of_a_job_unit_and_of_a_holder(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    cgroup_procs(kernel.top, "train.service", 400)
    proc.add(400, {}, memlock="65536")
    config = Config(doctor=DoctorConfig(job_units=("train.service",)))
    result = checks(kernel, config).check_memlock()
    assert result.status == "FAIL" and result.detail.startswith("train.service (PID 400)")
    assert "systemctl edit train.service: [Service] LimitMEMLOCK=infinity" in result.fix
    proc.remove(400)
    proc.add(400, {})
    proc.add(100, {4: "/dev/vfio/12"}, memlock="65536")
    result = checks(kernel, config).check_memlock()
    assert result.status == "FAIL" and result.detail.startswith("holder PID 100 (python3 train.py)")
    proc.remove(100)
    proc.add(100, {4: "/dev/vfio/12"})
    detail = checks(kernel, config).check_memlock().detail
    assert detail == "memlock unlimited or CAP_IPC_LOCK: train.service, holder PID 100"


def test_the_daemons_endpoint_scans_holders_at_scrape_time_at_most_every_interval(tree):
    from tpuboot import metrics

    kernel, proc = tree
    add_chips(kernel, ["4", "5"])
    with metrics.use(metrics.Metrics()) as m:
        metrics_export.watch_holders(kernel.root, Config())
        value = metrics_export.registry_of(m).get_sample_value
        assert value("tpuboot_chip_holders", {"chip": "0000:00:04", "state": "running"}) == 0
        collector = metrics_export.exported(m).holders
        assert isinstance(collector, metrics_export.HolderCollector)
        proc.add(300, {5: "/dev/vfio/5"}, state="T")
        assert value("tpuboot_chip_holders", {"chip": "0000:00:05", "state": "stopped"}) is None  # cached
        collector._at -= collector.min_interval  # the interval has passed
        assert value("tpuboot_chip_holders", {"chip": "0000:00:05", "state": "stopped"}) == 1
        metrics_export.watch_holders(kernel.root, Config())  # a daemon built again: one collector
        assert metrics_export.exposition(m).count(b"# TYPE tpuboot_chip_holders gauge") == 1
