"""The reset ladder on a fake kernel: each rung in order, stopping at the first that brings the
chip back bound and usable; rungs the kernel does not offer skipped; the circuit breaker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.config import VfioConfig
from tpuboot.devices.chips import chips_present
from tpuboot.devices.reset import BREAKER_PATH, RESET_LOCK, Breaker, Ladder, ResetRefused
from tpuboot.devices.survey import survey
from tpuboot.devices.table import GOOGLE, DeviceTable
from tpuboot.devices.vfio import Binder

V5P = (GOOGLE, 0x0062, (GOOGLE, 0x00AD))
TPU7X = (GOOGLE, 0x0076, (GOOGLE, 0x00F2))
GONE = b"\xff" * 64


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


def wedge(kernel: FakeKernel, address: str) -> None:
    kernel.p(f"/sys/bus/pci/devices/{address}/config").write_bytes(GONE)


def unwedge(kernel: FakeKernel, address: str) -> None:
    kernel.p(f"/sys/bus/pci/devices/{address}/config").write_bytes(b"\xe0\x1a\x62\x00" + bytes(60))


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
    assert cli.main([*root, "reset", "--dry-run", "00:09.0"]) == cli.EXIT_OK  # gone: a rescan's plan
    assert (
        capsys.readouterr().out
        == "remove-rescan: 0000:00:09.0 is gone from sysfs: rescan the PCI bus, bind it again\n"
    )
    assert kernel.writes == []


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
