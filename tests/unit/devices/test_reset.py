"""The reset ladder on a fake kernel: each rung in order, stopping at the first that brings the
chip back bound and usable; rungs the kernel does not offer skipped; the circuit breaker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import unwedge, wedge
from tpuboot.config import VfioConfig
from tpuboot.devices.chips import chips_present
from tpuboot.devices.reset import BREAKER_PATH, RESET_LOCK, Breaker, Ladder, ResetRefused
from tpuboot.devices.survey import survey
from tpuboot.devices.table import GOOGLE, DeviceTable
from tpuboot.devices.vfio import Binder

V5P = (GOOGLE, 0x0062, (GOOGLE, 0x00AD))
TPU7X = (GOOGLE, 0x0076, (GOOGLE, 0x00F2))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def setup(tmp_path: Path, ids=V5P, functions=1, reset_method: str | None = "flr bus"):
    kernel = FakeKernel(tmp_path)
    kernel.load_module("vfio-pci")
    for fn in range(functions):
        address = f"0000:05:00.{fn}"
        kernel.add_device(address, ids[0], ids[1], ids[2], driver="vfio-pci", group=str(30 + fn))
        kernel.p(f"/dev/vfio/{30 + fn}").chmod(0o666)
        if reset_method is not None:
            kernel.p(f"/sys/bus/pci/devices/{address}/reset").touch()
            kernel.p(f"/sys/bus/pci/devices/{address}/reset_method").write_text(reset_method + "\n")
    table = DeviceTable()
    binder = Binder(
        kernel.root, table, VfioConfig(node_timeout=0.05), write=kernel.write, load_module=kernel.load_module
    )
    (chip,) = chips_present(kernel.root, table, survey(binder))
    clock = Clock()
    ladder = Ladder(binder, Breaker(kernel.root, 3, clock), rescan_timeout=0.5, sleep=lambda s: None)
    return kernel, chip, ladder, clock


def test_a_function_reset_that_brings_the_chip_back_is_the_only_rung(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    wedge(kernel, "0000:05:00.0")
    kernel.on_reset = lambda address: unwedge(kernel, address)
    steps = ladder.climb(chip)
    assert [(s.rung, s.back) for s in steps] == [("function-reset", True)]
    assert ("/sys/bus/pci/devices/0000:05:00.0/reset", "1") in kernel.writes
    assert kernel.driver("0000:05:00.0") == "vfio-pci"


def test_without_a_reset_method_the_ladder_climbs_to_remove_and_rescan(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path, reset_method=None)
    wedge(kernel, "0000:05:00.0")  # stays wedged through a rebind; a rescan makes a new function
    steps = ladder.climb(chip)
    assert [(s.rung, s.back) for s in steps] == [("rebind", False), ("remove-rescan", True)]
    assert steps[0].problem == "0000:05:00.0 does not answer config reads"
    assert kernel.driver("0000:05:00.0") == "vfio-pci"
    assert kernel.p("/dev/vfio/30").exists()


def test_a_rebind_that_helps_stops_before_remove(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    wedge(kernel, "0000:05:00.0")  # a function reset does not help; the driver's teardown does

    def unbind_mends(path: Path, value: str) -> None:
        FakeKernel.write(kernel, path, value)
        if path.name == "unbind":
            unwedge(kernel, value)

    ladder.binder.write = unbind_mends
    steps = ladder.climb(chip)
    assert [(s.rung, s.back) for s in steps] == [("function-reset", False), ("rebind", True)]
    assert not any(path.endswith("/remove") for path, _ in kernel.writes)


def test_the_bind_after_a_rung_mends_a_node_that_lost_its_mode(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    kernel.p("/dev/vfio/30").chmod(0o600)
    assert [(s.rung, s.back) for s in ladder.climb(chip)] == [("function-reset", True)]
    assert kernel.p("/dev/vfio/30").stat().st_mode & 0o777 == 0o666


def test_every_function_of_a_two_function_chip_is_reset(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path, ids=TPU7X, functions=2)
    reset: list[str] = []
    kernel.on_reset = reset.append
    assert [s.back for s in ladder.climb(chip)] == [True]
    assert reset == ["0000:05:00.0", "0000:05:00.1"]


def test_a_chip_that_never_comes_back_climbs_every_rung_and_says_why(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    wedge(kernel, "0000:05:00.0")
    kernel.on_reset = lambda address: None
    original = kernel.write

    def rescan_finds_it_wedged(path: Path, value: str) -> None:
        original(path, value)
        if path.name == "rescan":
            wedge(kernel, "0000:05:00.0")

    ladder.binder.write = rescan_finds_it_wedged
    steps = ladder.climb(chip)
    assert [(s.rung, s.back) for s in steps] == [
        ("function-reset", False),
        ("rebind", False),
        ("remove-rescan", False),
    ]
    assert all(s.problem for s in steps)


def test_a_function_that_does_not_come_back_from_a_rescan_is_a_failed_rung(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path, reset_method=None)
    wedge(kernel, "0000:05:00.0")
    kernel.specs.clear()  # the rescan finds nothing
    kernel.write = lambda path, value: (
        None if path.name == "rescan" else FakeKernel.write(kernel, path, value)
    )
    ladder.binder.write = kernel.write
    steps = ladder.climb(chip)
    assert steps[-1].rung == "remove-rescan" and steps[-1].done == "failed"
    assert "did not come back after a rescan" in (steps[-1].problem or "")


def test_the_breaker_refuses_a_fourth_reset_in_an_hour_and_forgets_after_it(tmp_path):
    _kernel, chip, ladder, clock = setup(tmp_path)
    for _ in range(3):
        ladder.climb(chip)
        clock.now += 60
    with pytest.raises(ResetRefused, match=r"reset 3 times in the last hour .* try again in \d+ s"):
        ladder.climb(chip)
    clock.now += 3600
    assert ladder.climb(chip)[0].back


def test_a_damaged_breaker_record_does_not_block_resets(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    path = kernel.p(BREAKER_PATH)
    path.parent.mkdir(parents=True)
    for text in ("not json", "[1, 2]", '{"0000:05:00": "x"}', '{"0000:05:00": [1e400, "x"]}'):
        path.write_text(text)
        assert ladder.climb(chip)[0].back


def test_a_reset_under_way_refuses_another_and_the_lock_goes_with_it(tmp_path):
    """Another ladder holding the host's reset lock (the daemon's, another `tpuboot reset`): this
    one is refused in one line, touches nothing and records no reset; once that one ends (its fd
    closed, as when its process dies), the reset goes on."""
    import fcntl
    import os

    kernel, chip, ladder, _ = setup(tmp_path)
    wedge(kernel, "0000:05:00.0")
    kernel.p(RESET_LOCK).parent.mkdir(parents=True)
    other = os.open(kernel.p(RESET_LOCK), os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with pytest.raises(ResetRefused, match=r"another reset is under way on this host .* try again"):
            ladder.climb(chip)
        assert kernel.writes == [] and not kernel.p(BREAKER_PATH).exists()
    finally:
        os.close(other)
    assert ladder.climb(chip)[-1].back
    assert len(ladder.breaker.recent(chip.address)) == 1


def test_dry_run_plans_every_rung_and_touches_nothing(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    plan = ladder.plan(chip)
    assert [line.split(":")[0] for line in plan] == ["function-reset", "rebind", "remove-rescan"]
    assert "flr bus" in plan[0]
    assert kernel.writes == [] and not kernel.p(BREAKER_PATH).exists()
    _, chip, ladder, _ = setup(tmp_path / "other", reset_method=None)
    assert "offers no reset method" in ladder.plan(chip)[0]


def test_a_chip_the_kernel_removed_is_found_again_by_a_rescan_alone(tmp_path):
    kernel, chip, ladder, _ = setup(tmp_path)
    FakeKernel.write(kernel, kernel.p("/sys/bus/pci/devices/0000:05:00.0/remove"), "1")
    steps = ladder.climb(chip)
    assert [(s.rung, s.back) for s in steps] == [("remove-rescan", True)]
    assert kernel.driver("0000:05:00.0") == "vfio-pci"


def test_the_cli_plans_under_root_refuses_to_act_there_and_never_resets_a_non_tpu(tmp_path, capsys):
    from tpuboot import cli

    kernel, _, _, _ = setup(tmp_path)
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")  # the boot disk
    root = ["--root", str(kernel.top)]
    assert cli.main([*root, "reset", "--dry-run", "05:00.0"]) == cli.EXIT_OK
    assert capsys.readouterr().out.startswith("function-reset: write 1 to reset of 0000:05:00.0 (")
    assert cli.main([*root, "reset", "05:00.0"]) == cli.EXIT_USAGE
    assert "cannot act on a --root tree" in capsys.readouterr().err
    assert cli.main([*root, "reset", "--dry-run", "00:02.0"]) == cli.EXIT_FAILED
    assert "0000:00:02.0 is not a TPU; tpuboot never resets another device" in capsys.readouterr().err
    assert kernel.writes == []


@pytest.mark.parametrize("address", ["00:09.0", "05:01.0", "0001:05:00.0"])
def test_an_address_that_is_no_function_here_and_no_chip_tpuboot_reset_is_refused(tmp_path, capsys, address):
    """A typo (a slot with nothing in it, a TPU's neighbour, another domain) is no reason to
    rescan the bus: refused in one line, in the dry run as in the real one, before any write."""
    from tpuboot import cli

    kernel, _, _, _ = setup(tmp_path)
    for dry in (["--dry-run"], []):
        code = cli.main(["--root", str(kernel.top), "reset", *dry, address])
        err = capsys.readouterr().err
        if dry:
            assert code == cli.EXIT_FAILED
            assert err.startswith("tpuboot: ") and err.count("\n") == 1
            assert "is no PCI function here, and tpuboot has no record of a TPU there" in err
    assert kernel.writes == [] and not kernel.p(BREAKER_PATH).exists()


@pytest.mark.parametrize("record", ["breaker", "baseline"])
def test_a_chip_tpuboot_reset_and_lost_is_found_again_by_a_rescan(tmp_path, capsys, record):
    """A chip in tpuboot's own records (the breaker's: reset in the last hour; the AER baselines:
    brought back this boot) that sysfs no longer lists: a rescan is the plan."""
    import json

    from tpuboot import cli
    from tpuboot.devices.health import BASELINE_PATH

    kernel, _, _, clock = setup(tmp_path)
    FakeKernel.write(kernel, kernel.p("/sys/bus/pci/devices/0000:05:00.0/remove"), "1")
    if record == "breaker":
        path, data = kernel.p(BREAKER_PATH), {"0000:05:00": [clock.now]}
    else:
        path, data = kernel.p(BASELINE_PATH), {"0000:05:00.0": {"fatal": 0}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    assert cli.main(["--root", str(kernel.top), "reset", "--dry-run", "05:00.0"]) == cli.EXIT_OK
    assert (
        capsys.readouterr().out
        == "remove-rescan: 0000:05:00.0 is gone from sysfs: rescan the PCI bus, bind it again\n"
    )


def test_errors_a_reset_cleared_up_are_history_until_new_ones_come(tmp_path):
    from tpuboot.devices.health import judge, read_health

    kernel, chip, ladder, _ = setup(tmp_path)
    aer = kernel.p("/sys/bus/pci/devices/0000:05:00.0/aer_dev_fatal")
    aer.write_text("DLP 1\nTOTAL_ERR_FATAL 1\n")
    assert [f.level for f in judge(read_health(kernel.root, "0000:05:00.0"))] == ["FAIL"]
    assert ladder.climb(chip)[-1].back
    assert judge(read_health(kernel.root, "0000:05:00.0")) == []  # the counter since boot is still 1
    aer.write_text("DLP 2\nTOTAL_ERR_FATAL 2\n")
    (finding,) = judge(read_health(kernel.root, "0000:05:00.0"))
    assert finding.detail == "0000:05:00.0 logged 1 fatal PCIe error(s) since its last reset"


def test_the_dry_run_says_what_the_real_run_would_refuse_naming_the_holders(tmp_path, capsys):
    """A held chip and an open breaker: the plan, then each refusal in a line of its own (the
    holder named as `tpuboot who` names it), exit 1; with --kill, the holder it would end."""
    from tests.unit.fakes.proc import FakeProc
    from tpuboot import cli

    kernel, chip, _, _ = setup(tmp_path)
    root = ["--root", str(kernel.top)]
    assert cli.main([*root, "reset", "--dry-run", "05:00.0"]) == cli.EXIT_OK
    assert capsys.readouterr().err == ""
    proc = FakeProc(kernel.top)
    proc.user(1001, "alice")
    proc.add(4242, {7: "/dev/vfio/30"}, uid=1001, cmdline=["python3", "train.py"])
    assert cli.main([*root, "reset", "--dry-run", "05:00.0"]) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert out.startswith("function-reset: ")
    (line,) = err.splitlines()
    assert line.startswith("tpuboot: the reset would be refused: chip 0000:05:00 is held by PID 4242 (alice")
    assert line.endswith("python3 train.py; end it first, or pass --kill to end it first")
    assert cli.main([*root, "reset", "--dry-run", "--kill", "05:00.0"]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("--kill: would end PID 4242 (alice") and err == ""
    breaker = Breaker(kernel.root, 3)  # the command's clock: now
    for _ in range(3):
        breaker.record(chip.address)
    assert cli.main([*root, "reset", "--dry-run", "05:00.0"]) == cli.EXIT_FAILED
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2].split(" ")[0:2] for line in lines] == [["chip", "0000:05:00"]] * 2
    assert "reset 3 times in the last hour" in lines[0] and "is held by PID 4242" in lines[1]
    assert kernel.writes == []


def test_the_dry_run_refuses_a_chip_that_may_be_held_as_the_real_run_does(tmp_path, capsys):
    """A VFIO device fd the kernel does not tie to a device: the chip may be held, and --kill
    would not help (it ends known holders only): one line naming the holder, exit 1."""
    from tests.unit.fakes.proc import FakeProc
    from tpuboot import cli

    kernel, _, _, _ = setup(tmp_path)
    FakeProc(kernel.top).add(4343, {5: "anon_inode:[vfio-device]"}, cmdline=["python3", "serve.py"])
    for kill in ([], ["--kill"]):
        assert (
            cli.main(["--root", str(kernel.top), "reset", "--dry-run", *kill, "05:00.0"]) == cli.EXIT_FAILED
        )
        out, err = capsys.readouterr()
        (line,) = err.splitlines()
        assert line.startswith("tpuboot: the reset would be refused: chip 0000:05:00 may be held: PID 4343 ")
        assert "chip unknown" in line and line.endswith("; run as root, or wait")
        assert "would end" not in out
    assert kernel.writes == []


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        "null",
        '"text"',
        '{"0000:05:00": "x"}',
        '{"0000:05:00": [1e400]}',
        '{"0000:05:00": [NaN]}',
        '{"0000:05:00": [-Infinity]}',
        '{"0000:05:00": [true]}',
        '{"0000:05:00": [' + "9" * 400 + "]}",
        '{"0000:05:00": [' + "9" * 5000 + "]}",
        '{"0000:05:00": [-1]}',
        '{"0000:05:00": [1000000.0], "not an address": [1000000.0]}',
        '{"0000:05:00": {"at": 1}}',
        "[" * 100_000,
        '{"0000:05:00": [1000000.0]}\xff',
    ],
)
def test_a_damaged_breaker_record_is_forgotten_with_one_journal_line(tmp_path, caplog, text):
    """Wrong shape, wrong types, huge numbers, NaN, nested deep, not UTF-8: forgotten whole, as
    a garbled one is; the reset goes on, and one line says so (the climb reads it twice)."""
    kernel, chip, ladder, _ = setup(tmp_path)
    path = kernel.p(BREAKER_PATH)
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("utf-8", "surrogateescape").replace(b"\xc3\xbf", b"\xff"))
    caplog.set_level("WARNING", logger="tpuboot.reset")
    assert ladder.climb(chip)[0].back
    said = [r.getMessage() for r in caplog.records if r.name == "tpuboot.reset"]
    assert len(said) == 1 and said[0].startswith(f"reset breaker: {BREAKER_PATH} is damaged (")
    assert said[0].endswith("its resets are forgotten (the next reset writes it anew)")
    assert len(ladder.breaker.recent(chip.address)) == 1  # written anew, with this reset alone


def test_a_breaker_record_of_the_right_shape_is_kept(tmp_path):
    import json

    kernel, chip, ladder, clock = setup(tmp_path)
    path = kernel.p(BREAKER_PATH)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"0000:05:00": [int(clock.now) - 10, clock.now - 20.5], "10000:01:00": []}))
    assert len(ladder.breaker.recent(chip.address)) == 2
    assert sorted(ladder.breaker.chips()) == ["0000:05:00", "10000:01:00"]  # a VMD domain is 5 digits


NOBODY = 65534


@pytest.fixture
def shared(tmp_path_factory):
    """A folder any user can reach (pytest's tmp_path is under a 0700 directory)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="tpuboot-reset-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def as_nobody(code: str, *args: str):
    import subprocess
    import sys

    top = Path(__file__).resolve().parents[3]
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        user=NOBODY,
        env={"PYTHONPATH": str(top), "PATH": "/usr/bin:/bin", "HOME": "/"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="needs root, to run as nobody")
def test_a_reset_by_another_user_is_refused_in_one_line_that_says_it_needs_root(shared):
    """The command, before it reads a record or writes anything; and the lock, for any other
    way in (open_lock's message alone spoke of CAP_DAC_OVERRIDE, as for the service)."""
    command = "import sys; from tpuboot import cli; sys.exit(cli.main(sys.argv[1:]))"
    done = as_nobody(command, "reset", "00:04.0")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "tpuboot: not root; a reset needs root: run it as root (sudo tpuboot reset DBDF)\n"
    (shared / "var/lib/tpuboot").mkdir(parents=True)  # root's, 0755, as the package makes it
    code = (
        "import sys\n"
        "from tpuboot.devices.reset import ResetRefused, one_at_a_time\n"
        "from tpuboot.paths import Root\n"
        "try:\n"
        "    with one_at_a_time(Root(sys.argv[1])):\n"
        "        print('locked')\n"
        "except ResetRefused as exc:\n"
        "    print(exc)\n"
    )
    done = as_nobody(code, str(shared))
    assert done.stdout.startswith(f"cannot open {RESET_LOCK}: permission denied"), done.stderr
    assert done.stdout.endswith("; a reset needs root: run it as root (sudo tpuboot reset DBDF)\n")
    assert not (shared / RESET_LOCK.lstrip("/")).exists()
