"""`tpuboot wait-maintenance` on a real tree: it returns once the daemon's file says the host goes
away (written from another thread, as the daemon would), --check answers at once, exit codes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tpuboot import cli
from tpuboot.notices import noticefile
from tpuboot.notices.parse import MAINTENANCE, PREEMPTED, UPCOMING, Notice, idle
from tpuboot.paths import Root

QUIET = [idle(PREEMPTED), idle(MAINTENANCE), idle(UPCOMING)]


@pytest.fixture
def tree(tmp_path: Path) -> Root:
    (tmp_path / "root").mkdir()
    return Root(tmp_path / "root")


def run(tree: Root, *argv: str) -> int:
    return cli.main(["--root", str(tree.prefix), *argv])


def test_it_waits_for_the_file_to_say_so_and_prints_the_notice(tree: Root, capsys) -> None:
    noticefile.save(tree, QUIET)
    told = threading.Event()

    def daemon() -> None:  # the daemon's writes: first an unrelated kind, then the one asked for
        told.wait(10)
        noticefile.save(
            tree,
            [idle(PREEMPTED), Notice(MAINTENANCE, True, "TERMINATE_ON_HOST_MAINTENANCE"), idle(UPCOMING)],
        )
        noticefile.save(tree, [Notice(PREEMPTED, True, "TRUE"), idle(MAINTENANCE), idle(UPCOMING)])

    writer = threading.Thread(target=daemon)
    writer.start()
    assert run(tree, "wait-maintenance", "--check") == 1
    told.set()
    assert run(tree, "wait-maintenance", "--kind", "preempted", "--timeout", "30") == 0
    writer.join()
    assert capsys.readouterr().out == "preempted TRUE\n"


def test_check_and_json_and_the_timeout(tree: Root, capsys) -> None:
    assert run(tree, "wait-maintenance", "--check") == 1
    assert "no /run/tpuboot/notice: is tpuboot running with notices.enabled?" in capsys.readouterr().err
    noticefile.save(tree, QUIET)
    assert run(tree, "wait-maintenance", "--timeout", "0.1") == 1
    assert capsys.readouterr().err == "tpuboot: no notice in 0.1 s\n"
    when = Notice(UPCOMING, True, "SCHEDULED PENDING", None)
    noticefile.save(tree, [idle(PREEMPTED), idle(MAINTENANCE), when])
    assert run(tree, "wait-maintenance", "--check", "--json") == 0
    assert json.loads(capsys.readouterr().out) == [
        {"kind": "upcoming", "value": "SCHEDULED PENDING", "window_start": None}
    ]
    assert run(tree, "wait-maintenance", "--check", "--kind", "preempted") == 1


def test_a_bad_kind_is_a_usage_error(tree: Root) -> None:
    with pytest.raises(SystemExit) as exited:
        run(tree, "wait-maintenance", "--kind", "nonsense")
    assert exited.value.code == 2


def test_status_shows_an_active_notice(tree: Root, capsys) -> None:
    noticefile.save(tree, [Notice(PREEMPTED, True, "TRUE"), idle(MAINTENANCE), idle(UPCOMING)])
    run(tree, "status")
    assert capsys.readouterr().out.splitlines()[-1] == "notice: preempted TRUE"
