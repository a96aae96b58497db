"""Reads of /proc and sysfs files (tpuboot/kernelfiles.py): a FIFO or a directory where the kernel
has a file is refused at once (opening a FIFO would wait for a writer), a huge file is read
to the bound, and the PCIe health readings that use it go on past each."""

from __future__ import annotations

import os
from pathlib import Path

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.devices.health import read_link
from tpuboot.kernelfiles import read_bytes, read_text, start_ticks
from tpuboot.paths import MAX_FILE_BYTES, Root

A = "0000:00:04.0"


def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x\n")
    root = Root(tmp_path)
    assert read_text(root, "/fifo") is None and read_text(root, "/dir") is None
    assert read_text(root, "/missing") is None
    assert read_text(root, "/file") == "x\n"


def test_a_huge_file_is_read_to_its_bound(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"7" * (3 * MAX_FILE_BYTES))
    root = Root(tmp_path)
    assert len(read_bytes(root, "/big") or b"") == MAX_FILE_BYTES
    assert read_bytes(root, "/big", 10) == b"7" * 10


def test_a_process_start_is_read_past_a_command_with_parentheses(tmp_path: Path) -> None:
    """/proc/PID/stat's start time (field 22), after a command that holds ") (" and spaces; None
    when the process is gone or the field is not the kernel's digits."""
    proc = tmp_path / "proc"
    for pid, start in ((7, "4242"), (8, "42x")):
        (proc / str(pid)).mkdir(parents=True)
        fields = ["S", "1", *["0"] * 17, start, *["0"] * 30]
        (proc / str(pid) / "stat").write_text(f"{pid} (a) (b c) {' '.join(fields)}\n")
    root = Root(tmp_path)
    assert start_ticks(root, 7) == 4242
    assert start_ticks(root, 8) is None and start_ticks(root, 9) is None


def test_pcie_link_readings_go_on_past_a_fifo(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    kernel.add_device(A, 0x1AE0, 0x0062)
    d = kernel.p(f"/sys/bus/pci/devices/{A}")
    os.mkfifo(d / "current_link_speed")
    (d / "current_link_width").write_text("16\n")
    (d / "max_link_speed").write_text("16.0 GT/s PCIe\n")
    (d / "max_link_width").write_text("16\n")
    link = read_link(kernel.root, A)
    assert link is not None and (link.speed, link.width, link.max_speed, link.max_width) == (
        None,
        16,
        16.0,
        16,
    )


def test_a_width_the_kernel_does_not_know_is_no_lane_count(tmp_path: Path) -> None:
    """Just after an AER error the kernel may write x255 (PCIE_LNK_WIDTH_UNKNOWN): not 255 lanes."""
    kernel = FakeKernel(tmp_path)
    kernel.add_device(A, 0x1AE0, 0x0062)
    d = kernel.p(f"/sys/bus/pci/devices/{A}")
    for name, value in [("current_link_speed", "2.5 GT/s PCIe"), ("current_link_width", "255"),
                        ("max_link_speed", "2.5 GT/s PCIe"), ("max_link_width", "1")]:  # fmt: skip
        (d / name).write_text(f"{value}\n")
    link = read_link(kernel.root, A)
    assert link is not None and (link.width, link.max_width) == (None, 1)
