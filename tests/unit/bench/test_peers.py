"""Unit tests of the peers' pure parts of the bench (bench/peers.py, the table).

No root, no QEMU, no network: they run with ``-m "not vm"``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import peers
from bench.idle import requests_per_minute
from bench.table import Report, Row, markdown_table, table_cells

REPO = Path(__file__).resolve().parents[3]

SHIPPED_CFG = """[Daemons]
accounts_daemon = true
clock_skew_daemon = true
network_daemon = true

[InstanceSetup]
network_enabled = true

[NetworkInterfaces]
dhclient_script = /sbin/google-dhclient-script
ip_forwarding = true
setup = true
"""


def test_gga_config_turns_off_only_the_network_managers() -> None:
    out = peers.gga_config(SHIPPED_CFG)
    assert "network_daemon = false" in out
    assert "[NetworkInterfaces]\ndhclient_script = /sbin/google-dhclient-script\n" in out
    assert "ip_forwarding = false\nsetup = false" in out
    assert "accounts_daemon = true" in out and "clock_skew_daemon = true" in out
    assert "network_enabled = true" in out  # [InstanceSetup]'s key of another name stays


def test_row_against_a_peer_gives_ratio_and_verdict() -> None:
    row = Row("m", "1.000 s", "2.000 s", 0.5).against("driverctl", "0.5 s", 2.0, 1.0)
    assert (row.peer, row.peer_ratio, row.peer_goal, row.peer_verdict) == (
        "driverctl: 0.5 s",
        2.0,
        "<= 1x",
        "FAIL",
    )
    info = Row("m", "1", "2").against("driverctl", "1 s", None)
    assert info.peer_goal == "" and info.peer_verdict == ""


def test_row_at_most_counts_zero_as_met_and_more_as_not() -> None:
    assert Row("ticks", "0", "").at_most("gga", "0", 0, 0).peer_verdict == "PASS"
    over = Row("ticks", "3", "").at_most("gga", "0", 3, 0)
    assert over.peer_verdict == "FAIL" and over.peer_ratio is None
    under = Row("ticks", "2", "").at_most("gga", "8", 2, 8)
    assert under.peer_verdict == "PASS" and under.peer_ratio == pytest.approx(0.25)


def test_table_has_the_peer_columns() -> None:
    report = Report()
    report.add("cli", Row("a | b", "1", "2", 0.5, "<= 1x", "PASS").against("driverctl", "3", 1 / 3, 1.0))
    report.add("cli", Row("  sub", "1", "2"))
    lines = markdown_table(report).splitlines()
    assert lines[0].count("|") == 11 and all(line.count("|") == 11 for line in lines)
    assert lines[2] == "| a / b | 1 | 2 | 0.50x | <= 1x | PASS | driverctl: 3 | 0.33x | <= 1x | PASS |"
    assert lines[3].startswith("| &nbsp;&nbsp;sub |")
    assert len(table_cells(Row("x", "1", "2"))) == 10


def test_requests_per_minute() -> None:
    assert requests_per_minute({"metadata_requests": 2, "window_s": 60.0}) == "2.0/min"
    assert requests_per_minute({"metadata_requests": None, "window_s": 60.0}) == "n/a"
