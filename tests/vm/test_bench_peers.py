"""Unit tests of the peers' pure parts of the bench (bench/peers.py, bench/gce_mds.py, the table).

No root, no QEMU, no network: they run with ``-m "not vm"``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from bench import peers
from bench.run import Report, Row, markdown_table, requests_per_minute, table_cells

REPO = Path(__file__).resolve().parents[2]

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


def _load_gce_mds(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "harness"))  # the guest finds mds_emulator beside it
    spec = importlib.util.spec_from_file_location("bench_gce_mds", REPO / "bench" / "gce_mds.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gce_emulator_nests_the_tree_and_long_polls_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    gce = _load_gce_mds(monkeypatch)
    assert gce.nested({"instance/id": "1", "instance/attributes/k": "v", "project/x": "y"}, "") == {
        "instance": {"attributes": {"k": "v"}, "id": "1"},
        "project": {"x": "y"},
    }
    with gce.GceEmulator({"k": "v"}, instance={"id": "7"}, port=0) as emulator:
        base = f"http://{emulator.host}/computeMetadata/v1/"

        def get(query: str, timeout: float = 5.0) -> tuple[dict[str, object], str]:
            request = urllib.request.Request(base + query, headers={"Metadata-Flavor": "Google"})
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read()), answer.headers["ETag"]

        tree, etag = get("?recursive=true&alt=json")
        assert tree == {"instance": {"attributes": {"k": "v"}, "id": "7"}}
        assert get("/?recursive=true&alt=json") == (tree, etag)  # the guest agent's ".../v1//"
        # Behind (an old etag): at once. Current etag: waits, and a change under the tree wakes it.
        assert get("?recursive=true&wait_for_change=true&last_etag=old")[1] == etag
        box: dict[str, object] = {}
        poll = threading.Thread(
            target=lambda: box.update(
                r=get(f"?recursive=true&wait_for_change=true&last_etag={etag}&timeout_sec=30")
            )
        )
        poll.start()
        poll.join(0.5)
        assert poll.is_alive(), "a directory long-poll with the current etag answered at once"
        emulator.set_attribute("k", "w")
        poll.join(10)
        assert not poll.is_alive()
        new_tree, new_etag = box["r"]  # type: ignore[misc]
        assert new_tree == {"instance": {"attributes": {"k": "w"}, "id": "7"}} and new_etag != etag
        timed = get(f"?recursive=true&wait_for_change=true&last_etag={new_etag}&timeout_sec=1")
        assert timed[1] == new_etag  # the timeout ends the wait with the same tree
    assert "mds_emulator" in sys.modules
