"""Holders as a hostile local user would attack them: every way to hold a chip counted (group
node, VFIO device cdev, a device fd whose group fd was closed, an accel node; by device number on
this host, whatever the link's text says), what a scan could not see never taken as free, reads
that block or are not files, lock files swapped between the scan and the removal, text that would
forge a line of output, and numbers that are not the kernel's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.fakes.proc import FakeProc
from tests.unit.helpers.devices import add_chips
from tests.unit.helpers.holders import chips, refuse_fds
from tpuboot import cli
from tpuboot.errors import printable
from tpuboot.holders import bounded
from tpuboot.holders import scan as scan_module
from tpuboot.holders.locks import lock_table
from tpuboot.holders.procfs import CMDLINE_BYTES, ProcReader, boot_time, memlock
from tpuboot.holders.release import release
from tpuboot.holders.report import gather, render
from tpuboot.holders.scan import scan
from tpuboot.holders.supervised import Supervised
from tpuboot.holders.targets import Targets
from tpuboot.paths import Root

NIC = (0x8086, 0x1572)  # an Intel NIC: a VFIO device that is no TPU


@pytest.fixture
def tree(tmp_path: Path) -> tuple[FakeKernel, FakeProc]:
    kernel = FakeKernel(tmp_path)
    (tmp_path / "tmp").mkdir()
    return kernel, FakeProc(tmp_path)


@pytest.fixture(autouse=True)
def no_worker_left_stuck() -> Iterator[None]:
    """A test that leaves a reader stuck would change what the next one sees."""
    yield
    assert not bounded._stuck


def cdev(kernel: FakeKernel, address: str, name: str, number: str) -> None:
    """``address``'s VFIO device cdev in sysfs, as vfio-pci registers it (Linux 6.6+)."""
    d = kernel.p(f"/sys/bus/pci/devices/{address}/vfio-dev/{name}")
    d.mkdir(parents=True)
    (d / "dev").write_text(f"{number}\n")


def fdinfo(proc: FakeProc, pid: int, fd: int, text: str) -> None:
    d = proc.proc / str(pid) / "fdinfo"
    d.mkdir(exist_ok=True)
    (d / str(fd)).write_text(text)


def holders(report) -> list[list[tuple[int, tuple[str, ...]]]]:
    return [[(h.process.pid, h.nodes) for h in c.holders] for c in report.chips]


# --- every way to hold a chip --------------------------------------------------------------------


def test_a_chip_held_through_its_vfio_device_cdev(tree):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    cdev(kernel, "0000:00:05.0", "vfio1", "511:1")
    proc.add(100, {3: "/dev/iommu", 4: "/dev/vfio/devices/vfio1"})
    report = gather(kernel.root, chips(kernel))
    assert holders(report) == [[], [(100, ("/dev/vfio/devices/vfio1",))]]
    assert not report.free and not report.maybe_held


def test_a_device_fd_whose_group_fd_was_closed_is_tied_by_its_fdinfo(tree):
    """VFIO lets a process close the group and keep the device fd; Linux 6.18 names its device."""
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.add(100, {5: "anon_inode:[vfio-device]"})
    fdinfo(proc, 100, 5, "pos:\t0\nflags:\t02\nvfio-device-syspath: /sys/devices/pci0000:00/0000:00:04.0\n")
    report = gather(kernel.root, chips(kernel))
    assert holders(report) == [[(100, ("anon_inode:[vfio-device] of 0000:00:04.0",))], []]
    assert not report.free and not report.maybe_held


def test_a_device_fd_that_names_no_device_is_held_chip_unknown(tree):
    """Before Linux 6.18 the fdinfo says nothing of the device: any chip may be the one held."""
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.add(100, {5: "anon_inode:[vfio-device]"})
    fdinfo(proc, 100, 5, "pos:\t0\nflags:\t02\nmnt_id:\t15\n")
    report = gather(kernel.root, chips(kernel))
    assert holders(report) == [[], []]
    assert not report.free and report.maybe_held
    (unknown,) = report.unknown
    assert unknown.process.pid == 100
    assert unknown.nodes == ("anon_inode:[vfio-device] (this kernel does not say of which device)",)
    (chip0, chip1) = [c.chip for c in report.chips]
    assert report.blockers(chip0) == report.blockers(chip1)
    assert "chip unknown" in report.blockers(chip0)[0]
    text = "\n".join(render(report))
    assert "holding a VFIO or accel device of a chip unknown (it may be any chip's):" in text


@pytest.mark.parametrize(
    ("fd", "info", "free"),
    [
        ("/dev/vfio/40", None, True),  # the NIC's group: another VFIO user's
        ("/dev/vfio/devices/vfio9", None, True),  # the NIC's cdev
        ("anon_inode:[vfio-device]", "vfio-device-syspath: /sys/devices/pci0000:00/0000:00:1f.0\n", True),
        ("/dev/vfio/77", None, False),  # a group no device here has: unknown
        ("/dev/vfio/77 (deleted)", None, False),
        ("/dev/vfio/devices/vfio3", None, False),  # a cdev of no device here
        ("anon_inode:[vfio-device]", "vfio-device-syspath: /sys/devices/pci0000:00/0000:00:09.0\n", False),
        ("/dev/accel3", None, False),  # an accel node of no chip
    ],
)
def test_a_vfio_fd_of_another_device_is_not_a_chips_but_one_of_no_device_may_be(tree, fd, info, free):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    kernel.add_device("0000:00:1f.0", *NIC, driver="vfio-pci", group="40")
    cdev(kernel, "0000:00:1f.0", "vfio9", "511:9")
    proc.add(100, {3: "/dev/vfio/vfio", 4: fd})
    if info is not None:
        fdinfo(proc, 100, 4, info)
    report = gather(kernel.root, chips(kernel))
    assert holders(report) == [[]]
    assert report.free is free
    assert bool(report.unknown) is not free


@pytest.fixture
def unhurried(monkeypatch) -> None:
    """A scan of this whole host waits for every process: under a loaded CI host the default
    patience and budget could leave the test's own child not seen (the safe answer, but not what
    these tests look at)."""
    monkeypatch.setattr(bounded, "PATIENCE", 600.0)
    monkeypatch.setattr(bounded, "BUDGET", 3600.0)


def test_the_host_matches_by_device_number_not_by_the_links_text(tmp_path, unhurried):
    """A node made under any name (as a bind mount in another mount namespace would show it)
    counts by its number; the real kernel's fds, a real child process."""
    alias = tmp_path / "not-a-dev-path"
    os.mknod(alias, 0o600 | 0o020000, os.stat("/dev/null").st_rdev)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); print(fd, flush=True); sys.stdin.read()",
            str(alias),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip()  # it holds the node now
        rdev = os.stat("/dev/null").st_rdev
        named = scan(Root("/"), Targets(by_number={rdev: "chip"}))
        assert "chip" in named.nodes.get(child.pid, set())
        unknown = scan(Root("/"), Targets(majors={os.major(rdev)}))
        assert any("(char 1:3)" in why for why in unknown.unknown.get(child.pid, set()))
        other = scan(Root("/"), Targets(majors={os.major(rdev)}, others={rdev}))
        assert child.pid not in other.unknown and child.pid not in other.nodes
    finally:
        child.kill()
        child.wait()


def test_the_host_does_not_take_a_file_named_like_a_node_for_the_node(tmp_path, unhurried):
    """A file whose link text reads /dev/vfio/12 in a mount namespace of its own is no node: on
    the host the text is never trusted (here: a regular file bind-mounted over /dev/null)."""
    decoy = tmp_path / "decoy"
    decoy.write_text("")
    script = (
        "import os, subprocess, sys; "
        f"subprocess.run(['mount', '--bind', '{decoy}', '/dev/null'], check=True); "
        "fd = os.open('/dev/null', os.O_RDONLY); print(os.readlink(f'/proc/self/fd/{fd}'), flush=True); "
        "sys.stdin.read()"
    )
    child = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "/dev/null"
        rdev = os.stat("/dev/null").st_rdev
        found = scan(Root("/"), Targets(by_text={"/dev/null": "text"}, by_number={rdev: "number"}))
        inner = [pid for pid, keys in found.nodes.items() if "text" in keys]
        assert inner == []  # the host never matches by text
        assert "number" not in found.nodes.get(child.pid, set())
    finally:
        child.kill()
        child.wait()


# --- unknown is not free -------------------------------------------------------------------------


def test_wait_free_and_who_do_not_exit_as_if_free_when_a_process_could_not_be_read(tree, monkeypatch, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    proc.add(200, {4: "/dev/vfio/12"})
    refuse_fds(monkeypatch, 200)
    assert cli.main(["--root", str(kernel.top), "who"]) == 1
    out = capsys.readouterr().out
    assert "    free" in out and "not seen: the open files of 1 process (PID 200)" in out
    assert cli.main(["--root", str(kernel.top), "wait-free", "--timeout", "0.1"]) == 1
    assert "could not be read (run as root to see them)" in capsys.readouterr().err
    assert cli.main(["--root", str(kernel.top), "who", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["free"] is False and data["unreadable_pids"] == [200]


def test_a_scan_that_cannot_list_proc_sees_nothing_and_says_so(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    (proc.proc).rename(kernel.top / "proc-elsewhere")
    report = gather(kernel.root, chips(kernel))
    assert not report.free
    assert (
        "not seen: /proc could not be listed, so no process was seen; a chip shown free may be held"
        in render(report)
    )


# --- no read can hang ----------------------------------------------------------------------------


@pytest.fixture
def patient(monkeypatch) -> None:
    """Five seconds of patience: long enough that a loaded host does not make a plain read of
    a two-process tree look stuck, short enough for the blocked one to be left behind."""
    monkeypatch.setattr(bounded, "PATIENCE", 5.0)


def test_a_process_whose_read_blocks_is_not_seen_and_the_scan_goes_on(tree, monkeypatch, patient):
    kernel, proc = tree
    add_chips(kernel, ["12", "13"])
    proc.add(100, {4: "/dev/vfio/12"})
    proc.add(300, {4: "/dev/vfio/13"})
    answer = threading.Event()
    blocked = threading.Event()
    real = scan_module._held

    def hangs_on_300(root, proc_dir, pid, targets):
        if pid == 300:
            blocked.set()
            answer.wait()
        return real(root, proc_dir, pid, targets)

    monkeypatch.setattr(scan_module, "_held", hangs_on_300)
    try:
        report = gather(kernel.root, chips(kernel))
        assert blocked.is_set()
        assert holders(report) == [[(100, ("/dev/vfio/12",))], []]
        assert report.unseen.unanswered == (300,) and not report.free
        assert any("(PID 300) did not answer" in line for line in render(report))
        again = gather(kernel.root, chips(kernel))  # still stuck: no second read of it
        assert again.unseen.unanswered == (300,)
    finally:
        answer.set()
        for worker in list(bounded._stuck.values()):
            worker.join()
    assert holders(gather(kernel.root, chips(kernel))) == [
        [(100, ("/dev/vfio/12",))],
        [(300, ("/dev/vfio/13",))],
    ]


def test_each_within_ends_by_its_budget_and_starts_no_worker_past_its_bound(monkeypatch):
    release_all = threading.Event()
    started: list[int] = []

    def work(item: int) -> int:
        started.append(item)
        if item < 100:
            release_all.wait()
        return item

    try:
        late = bounded.each_within([0, 1, 2], work, patience=30.0, budget=0.2)
        assert late.not_reached == [0, 1, 2] and not late.results and not late.complete
        for n in range(1, bounded.MAX_STUCK):
            assert bounded.each_within([10 * n], work, patience=0.2).unanswered == [10 * n]
        assert len(bounded._stuck) == bounded.MAX_STUCK
        crowded = bounded.each_within([100, 101], work, patience=0.2)
        assert crowded.not_reached == [100, 101] and 100 not in started  # no new worker at all
    finally:
        release_all.set()
        for worker in list(bounded._stuck.values()):
            worker.join()
    assert bounded.each_within([100, 101], work).results == {100: 100, 101: 101}


def test_reads_refuse_what_is_not_a_file_and_stop_at_their_bound(tree):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    d = proc.add(100, {4: "/dev/vfio/12"}, cmdline=["x" * (3 * CMDLINE_BYTES)])
    os.mkfifo(proc.add(101, {4: "/dev/vfio/12"}) / "cmdline.fifo")
    (d.parent / "101/cmdline").unlink()
    os.rename(d.parent / "101/cmdline.fifo", d.parent / "101/cmdline")  # opening it would wait for a writer
    report = gather(kernel.root, chips(kernel))
    by_pid = {h.process.pid: h.process for h in report.chips[0].holders}
    assert len(by_pid[100].command) == CMDLINE_BYTES
    assert by_pid[101].command == "[python3]"


# --- lock files: no race between the scan and the removal ---------------------------------------


def test_a_lock_file_swapped_since_the_scan_is_not_removed(tree):
    kernel, _ = tree
    tmp = kernel.top / "tmp"
    (tmp / "libtpu_lockfile").write_text("")
    report = gather(kernel.root, [])
    (tmp / "other").write_text("someone's")
    os.replace(tmp / "other", tmp / "libtpu_lockfile")
    (line,) = release(kernel.root, report, Supervised(), dry_run=False, kill=False)
    assert (
        line
        == "kept /tmp/libtpu_lockfile: it is another file than the one looked at (replaced since the scan)"
    )
    assert (tmp / "libtpu_lockfile").read_text() == "someone's"


@pytest.mark.parametrize("swap", ["fifo", "symlink"])
def test_a_lock_file_made_a_fifo_or_a_link_since_the_scan_is_not_removed(tree, swap):
    kernel, _ = tree
    tmp = kernel.top / "tmp"
    (tmp / "libtpu_lockfile").write_text("")
    (kernel.top / "victim").write_text("keep me")
    report = gather(kernel.root, [])
    (tmp / "libtpu_lockfile").unlink()
    if swap == "fifo":
        os.mkfifo(tmp / "libtpu_lockfile")
    else:
        os.symlink("/victim", tmp / "libtpu_lockfile")
    (line,) = release(kernel.root, report, Supervised(), dry_run=False, kill=False)
    assert line.startswith("kept /tmp/libtpu_lockfile") or line.startswith(
        "cannot remove /tmp/libtpu_lockfile"
    )
    assert (tmp / "libtpu_lockfile").exists() or (tmp / "libtpu_lockfile").is_symlink()
    assert (kernel.top / "victim").read_text() == "keep me"


def test_a_lock_directory_swapped_for_a_link_since_the_scan_is_not_followed(tree):
    kernel, _ = tree
    tmp = kernel.top / "tmp"
    (tmp / "libtpu_dir").mkdir()
    (tmp / "libtpu_dir/lock").write_text("")
    elsewhere = kernel.top / "etc-ish"
    elsewhere.mkdir()
    (elsewhere / "lock").write_text("keep me")
    report = gather(kernel.root, [])
    assert [lock.path for lock in report.locks] == ["/tmp/libtpu_dir/lock"]
    (tmp / "libtpu_dir/lock").unlink()
    (tmp / "libtpu_dir").rmdir()
    os.symlink(str(elsewhere), tmp / "libtpu_dir")
    (line,) = release(kernel.root, report, Supervised(), dry_run=False, kill=False)
    assert line.startswith(
        "kept /tmp/libtpu_dir/lock: its directory cannot be opened without following a link"
    )
    assert (elsewhere / "lock").read_text() == "keep me"


# --- text a user controls -------------------------------------------------------------------------


def test_a_command_line_and_a_lock_name_cannot_forge_lines(tree, capsys):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    forged = "train.py\nchip 1  TPU v5p  free\x1b[2J\u202e"
    proc.add(
        100, {4: "/dev/vfio/12"}, cmdline=["python3", forged], cgroup="0::/system.slice/x\x1b]0;t.service\n"
    )
    (kernel.top / "tmp/libtpu_lock\nfree").write_text("")
    assert cli.main(["--root", str(kernel.top), "who"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3  # the chip, its holder, the lock: nothing forged
    assert out[1].endswith(printable(f"python3 {forged}")) and "\\n" in out[1] and "\\x1b" in out[1]
    assert "\\u202e" in out[1] and "\x1b" not in "".join(out)
    assert out[2].startswith("lock /tmp/libtpu_lock\\nfree ")
    assert cli.main(["--root", str(kernel.top), "who", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["chips"][0]["holders"][0]["command"] == f"python3 {forged}"  # JSON stays exact
    assert data["locks"][0]["path"] == "/tmp/libtpu_lock\nfree"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain", "plain"),
        ("a\\b", "a\\\\b"),
        ("a\tb", "a\\tb"),
        ("\x00", "\\x00"),
        ("\u2028", "\\u2028"),
        ("é", "é"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(text, shown):
    assert printable(text) == shown


# --- numbers as the kernel writes them -----------------------------------------------------------


@pytest.mark.parametrize("odd", ["²", "١٢", "+5", "5_0", "0x5", "-", "9" * 30])
def test_odd_numbers_in_proc_never_crash_a_scan(tree, odd):
    kernel, proc = tree
    add_chips(kernel, ["12"])
    d = proc.add(100, {4: "/dev/vfio/12"})
    (d / "stat").write_text(f"100 (python3) S 1 {' '.join(['0'] * 17)} {odd} 0 0\n")
    proc.add(101, {4: "/dev/vfio/12"})
    (proc.proc / "101/status").write_text(
        f"Name:\tpy\nUid:\t{odd}\t0\t0\t0\nNSpid:\t101\t{odd}\nCapEff:\t{odd}\n"
    )
    (proc.proc / "101/limits").write_text(f"Max locked memory         {odd}\n")
    (proc.proc / "stat").write_text(f"btime {odd}\n")
    (kernel.top / "etc/passwd").write_text(f"eve:x:{odd}:0::/:/bin/sh\n")
    (proc.proc / "locks").write_text(
        f"1: POSIX  ADVISORY  WRITE {odd} 08:01:{odd} 0 EOF\n2: POSIX ADVISORY\n"
    )
    report = gather(kernel.root, chips(kernel))
    assert [h.process.pid for h in report.chips[0].holders] == [101]  # 100's stat is not the kernel's
    p = report.chips[0].holders[0].process
    assert p.uid == -1 and p.namespace_pid is None and p.started is None
    assert boot_time(kernel.root) is None and lock_table(kernel.root) == {}
    assert memlock(kernel.root, 101) is None
    assert ProcReader(kernel.root).users.names == {}


@pytest.mark.parametrize(
    ("options", "hides"),
    [("rw", False), ("rw,hidepid=0", False), ("rw,hidepid=off", False), ("rw,hidepid=2", True),
     ("rw,gid=4,hidepid=invisible", True), ("rw,hidepid=ptraceable", True)],
)  # fmt: skip
def test_a_proc_mounted_with_hidepid_is_known_to_hide_processes(tmp_path, options, hides):
    """hidepid leaves other users' processes out of a listing (not refused): a scan by another
    user than root cannot tell it saw them all, and says so."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mountinfo").write_text(
        "22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw\n"
        f"23 1 0:22 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc {options}\n"
    )
    assert scan_module.hides_processes(Root(tmp_path)) is hides


def test_a_hidden_proc_is_not_seen_and_said(tree):
    from tpuboot.holders.report import Report
    from tpuboot.holders.scan import Unseen

    report = Report([], (), [], unseen=Unseen(hidden=True))
    assert not report.free and report.maybe_held
    assert render(report)[-1] == (
        "not seen: /proc hides other users' processes (hidepid) from this user (run as root to see them);"
        " a chip shown free may be held"
    )
