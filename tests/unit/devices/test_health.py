"""PCIe health read from sysfs in the kernel's own formats: link state against its maximum, AER
counters by severity, reset methods, and a function that fell off the bus."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpuboot.devices.health import FAIL_FRACTION, Link, judge, parse_aer, parse_speed, read_health
from tpuboot.paths import Root

A = "0000:00:04.0"
# The kernel's aer_dev_* formats (drivers/pci/pcie/aer.c: one "name count" line per bit, then a total).
COUNTS = {"BadTLP": 3, "Timeout": 1}
CORRECTABLE = (
    "".join(
        f"{name} {COUNTS.get(name, 0)}\n"
        for name in (
            "RxErr",
            "BadTLP",
            "BadDLLP",
            "Rollover",
            "Timeout",
            "NonFatalErr",
            "CorrIntErr",
            "HeaderOF",
        )
    )
    + "TOTAL_ERR_COR 4\n"
)
UNCORRECTABLE = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
)
NONFATAL = (
    "".join(f"{name} {2 if name == 'CmpltTO' else 0}\n" for name in UNCORRECTABLE) + "TOTAL_ERR_NONFATAL 2\n"
)


def function(tmp_path: Path, config: bytes = b"\xe0\x1a\x62\x00", **files: str) -> Root:
    d = tmp_path / "sys/bus/pci/devices" / A
    d.mkdir(parents=True)
    (d / "config").write_bytes(config + bytes(60))
    for name, text in files.items():
        (d / name).write_text(text)
    return Root(tmp_path)


LINK_FULL = {
    "current_link_speed": "16.0 GT/s PCIe\n",
    "current_link_width": "16\n",
    "max_link_speed": "16.0 GT/s PCIe\n",
    "max_link_width": "16\n",
}


@pytest.mark.parametrize(
    ("text", "gts"),
    [("16.0 GT/s PCIe\n", 16.0), ("8 GT/s\n", 8.0), ("2.5 GT/s PCIe", 2.5), ("Unknown\n", None), ("", None)],
)
def test_speed_in_each_kernel_format(text: str, gts: float | None) -> None:
    assert parse_speed(text) == gts


def test_a_healthy_function_has_nothing_to_say(tmp_path: Path) -> None:
    health = read_health(function(tmp_path, **LINK_FULL, aer_dev_fatal="TOTAL_ERR_FATAL 0\n"), A)
    assert health.present and health.link is not None and health.link.fraction == 1.0
    assert health.errors("fatal") == 0 and health.errors("nonfatal") is None  # no file: no counter
    assert judge(health) == []


@pytest.mark.parametrize(
    ("width", "speed", "level"),
    [
        ("8", "16.0 GT/s PCIe", "FAIL"),  # x8 of x16: half the bandwidth
        ("16", "8.0 GT/s PCIe", "FAIL"),  # one generation down
        ("12", "16.0 GT/s PCIe", "WARN"),
        ("16", "16.0 GT/s PCIe", None),
        ("4", "2.5 GT/s PCIe", "FAIL"),
    ],
)
def test_a_degraded_link_warns_or_fails_by_how_far(
    tmp_path: Path, width: str, speed: str, level: str | None
) -> None:
    files = {**LINK_FULL, "current_link_width": width + "\n", "current_link_speed": speed + "\n"}
    findings = judge(read_health(function(tmp_path, **files), A))
    assert [f.level for f in findings] == ([level] if level else [])
    if level:
        assert f"x{width} of 16 GT/s x16" in findings[0].detail


def test_gen1_to_gen3_counts_the_encoding() -> None:
    # 5 GT/s 8b/10b is 4 Gb/s per lane; 8 GT/s 128b/130b is 7.88: not 62.5 % but about 51 %.
    fraction = Link(5.0, 16, 8.0, 16).fraction
    assert fraction is not None and 0.50 < fraction < 0.52 and fraction > FAIL_FRACTION


def test_a_link_with_unknown_parts_is_not_judged(tmp_path: Path) -> None:
    files = {**LINK_FULL, "current_link_speed": "Unknown\n"}
    health = read_health(function(tmp_path, **files), A)
    assert health.link is not None and health.link.fraction is None and judge(health) == []


def test_no_link_files_is_no_link(tmp_path: Path) -> None:
    assert read_health(function(tmp_path), A).link is None


def test_aer_counters_by_severity_and_their_findings(tmp_path: Path) -> None:
    root = function(
        tmp_path,
        aer_dev_correctable=CORRECTABLE,
        aer_dev_nonfatal=NONFATAL,
        aer_dev_fatal="Undefined 0\nDLP 1\nTOTAL_ERR_FATAL 1\n",
    )
    health = read_health(root, A)
    assert health.aer["correctable"]["BadTLP"] == 3
    assert (health.errors("correctable"), health.errors("nonfatal"), health.errors("fatal")) == (4, 2, 1)
    assert [f.level for f in judge(health)] == ["FAIL", "WARN"]  # correctable errors alone say nothing


def test_counters_without_a_total_line_are_summed() -> None:
    assert parse_aer("RxErr 2\ngarbage\nBadTLP x\nTimeout 5\n") == {"RxErr": 2, "Timeout": 5}


def test_a_function_that_fell_off_the_bus_fails_first(tmp_path: Path) -> None:
    health = read_health(function(tmp_path, config=b"\xff\xff\xff\xff", **LINK_FULL), A)
    assert not health.present
    (finding,) = judge(health)
    assert finding.level == "FAIL" and "fell off the bus" in finding.detail


def test_a_function_gone_from_sysfs_is_not_present(tmp_path: Path) -> None:
    assert not read_health(Root(tmp_path), A).present


def test_reset_methods_as_the_kernel_lists_them(tmp_path: Path) -> None:
    assert read_health(function(tmp_path, reset_method="flr bus\n"), A).reset_methods == ("flr", "bus")


def test_as_dict_has_every_field(tmp_path: Path) -> None:
    shown = read_health(function(tmp_path, **LINK_FULL, aer_dev_fatal="TOTAL_ERR_FATAL 0\n"), A).as_dict()
    assert shown["link"] == {
        "speed_gts": 16.0,
        "width": 16,
        "max_speed_gts": 16.0,
        "max_width": 16,
        "fraction": 1.0,
    }
    assert shown["aer_totals"] == {"correctable": None, "nonfatal": None, "fatal": 0}


def behind_a_port(tmp_path: Path, siblings: tuple[str, ...] = ()) -> Root:
    """Real sysfs's shape: bus/pci/devices/X a link into devices/pci0000:00/PORT/X."""
    port = tmp_path / "sys/devices/pci0000:00/0000:00:02.0"
    for name in ("0000:01:00.0", *siblings):
        (port / name).mkdir(parents=True)
        (port / name / "config").write_bytes(b"\xe0\x1a\x62\x00" + bytes(60))
        (port / name / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL 0\n")
    (port / "aer_rootport_total_err_fatal").write_text("2\n")
    (port / "aer_rootport_total_err_nonfatal").write_text("0\n")
    devices = tmp_path / "sys/bus/pci/devices"
    devices.mkdir(parents=True)
    for name in ("0000:00:02.0", "0000:01:00.0", *siblings):
        target = "0000:00:02.0" if name == "0000:00:02.0" else f"0000:00:02.0/{name}"
        (devices / name).symlink_to(f"../../../devices/pci0000:00/{target}")
    return Root(tmp_path)


def test_a_fatal_error_only_the_root_port_counted_is_the_chips_when_it_is_alone_below_it(
    tmp_path: Path,
) -> None:
    # Linux 6.1 does not read an endpoint's status after a fatal error: only the port counts it.
    health = read_health(behind_a_port(tmp_path), "0000:01:00.0")
    assert health.port == "0000:00:02.0" and health.errors("fatal") == 2 and health.errors("nonfatal") == 0
    (finding,) = judge(health)
    assert finding.level == "FAIL"
    assert finding.detail == (
        "0000:01:00.0 logged 2 fatal PCIe error(s) since boot (as its root port 0000:00:02.0 received them)"
    )


def test_a_port_shared_with_another_device_says_nothing_of_the_chip(tmp_path: Path) -> None:
    health = read_health(behind_a_port(tmp_path, siblings=("0000:01:01.0",)), "0000:01:00.0")
    assert health.port is None and health.errors("fatal") == 0 and judge(health) == []


def test_the_chips_own_functions_may_share_its_port(tmp_path: Path) -> None:
    health = read_health(behind_a_port(tmp_path, siblings=("0000:01:00.1",)), "0000:01:00.0")
    assert health.port == "0000:00:02.0" and health.errors("fatal") == 2


def test_the_summary_counts_each_kind_of_finding_once_per_function(tmp_path: Path) -> None:
    from tpuboot.devices.health import Health, Link, summary

    well = Health(A, True, Link(16.0, 16, 16.0, 16))
    assert summary([]) == "ok" and summary([well, well]) == "ok"
    lost = Health(A, False, None)
    degraded = Health(A, True, Link(8.0, 16, 16.0, 16))
    fatal = Health(A, True, Link(8.0, 8, 16.0, 16), {"fatal": {"DLP": 2, "TOTAL_ERR_FATAL": 2}})
    assert summary([well, lost, degraded, fatal]) == "lost:1,fatal:1,degraded:2"
