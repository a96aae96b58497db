"""The notice hooks on a real directory with real processes: order, what they are told, the
shared deadline (a hook and its children killed), refusals, 100 hooks, another user."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import tempfile
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from harness.polling import wait_until
from tpuboot.notices.hooks import HOOKS_DIR, find_hooks, hook_user, run_hooks
from tpuboot.notices.parse import MAINTENANCE, PREEMPTED, UPCOMING, UTC, Notice
from tpuboot.paths import Root

PREEMPTION = Notice(PREEMPTED, True, "TRUE")
SCHEDULED = Notice(UPCOMING, True, "SCHEDULED PENDING", datetime(2026, 12, 5, 14, 5, tzinfo=UTC))


@pytest.fixture
def tree(tmp_path: Path) -> Root:
    (tmp_path / "root" / HOOKS_DIR.lstrip("/")).mkdir(parents=True)
    os.chmod(tmp_path / "root" / HOOKS_DIR.lstrip("/"), 0o755)
    return Root(tmp_path / "root")


def hook(root: Root, name: str, body: str, mode: int = 0o755) -> Path:
    path = root.path(f"{HOOKS_DIR}/{name}")
    path.write_text(f"#!/bin/sh\n{body}\n")
    os.chmod(path, mode)
    return path


def test_hooks_run_in_name_order_told_the_notice_in_env_and_arguments(
    tree: Root, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "out"
    told = "$TPUBOOT_NOTICE_KIND|$TPUBOOT_NOTICE_VALUE|$TPUBOOT_NOTICE_WINDOW_START"
    line = f'echo "$(basename "$0") {told} $*" >> {out}'
    for name in ("20-drain", "10-checkpoint", "30-tell"):
        hook(tree, name, line)
    caplog.set_level(logging.INFO, "tpuboot.notices.hooks")
    results = run_hooks(find_hooks(tree), SCHEDULED, 25.0)
    window = "2026-12-05T14:05:00Z"
    assert out.read_text().splitlines() == [
        f"{name} upcoming|SCHEDULED PENDING|{window} upcoming SCHEDULED PENDING {window}"
        for name in ("10-checkpoint", "20-drain", "30-tell")
    ]
    assert [(r.name, r.status, r.killed) for r in results] == [
        ("10-checkpoint", 0, False), ("20-drain", 0, False), ("30-tell", 0, False)]  # fmt: skip
    lines = [r for r in caplog.records if r.name == "tpuboot.notices.hooks"]
    assert [r.getMessage().split(":")[0] for r in lines] == [
        "notice hook 10-checkpoint", "notice hook 20-drain", "notice hook 30-tell"]  # fmt: skip
    assert lines[0].HOOK_STATUS == "0" and lines[0].HOOK_KILLED == "0" and lines[0].NOTICE_KIND == "upcoming"


def test_a_notice_without_a_window_leaves_the_variable_out(tree: Root, tmp_path: Path) -> None:
    out = tmp_path / "out"
    hook(
        tree, "10-env", f'echo "${{TPUBOOT_NOTICE_WINDOW_START-unset}} $#" > {out}; env | grep -c . >> {out}'
    )
    run_hooks(find_hooks(tree), PREEMPTION, 25.0)
    window, count = out.read_text().splitlines()
    assert window == "unset 3"  # the third argument is empty
    assert int(count) <= 6  # PATH, LANG, the two notice variables (and what sh itself sets)


def test_a_hook_that_hangs_is_killed_with_its_children_at_the_deadline_and_the_rest_named(
    tree: Root, tmp_path: Path, caplog
) -> None:
    pids = tmp_path / "pids"
    hook(tree, "10-hangs", f"sleep 1000 & echo $! > {pids}; sh -c 'sleep 1000' & wait")
    hook(tree, "20-never", f"touch {tmp_path / 'ran'}")
    caplog.set_level(logging.INFO, "tpuboot.notices.hooks")
    results = run_hooks(find_hooks(tree), PREEMPTION, 1.0)
    assert [(r.name, r.killed, r.status) for r in results] == [("10-hangs", True, -9)]
    grandchild = int(pids.read_text())
    wait_until(lambda: not _alive(grandchild))  # its group was killed: init reaps it
    assert not (tmp_path / "ran").exists()
    said = [r.getMessage() for r in caplog.records]
    assert "notice hook 10-hangs: killed at the deadline" in said[0]
    assert said[1].startswith("notice hooks: the 1 s deadline passed; 1 not run: 20-never")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_refusals_each_one_line_and_a_readme_skipped_quietly(tree: Root, tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    hook(tree, "10-ok", f"echo ok >> {out}")
    hook(tree, "20-world", f"echo world >> {out}", 0o757)
    hook(tree, "30-group", f"echo group >> {out}", 0o775)
    os.chown(hook(tree, "40-user", f"echo user >> {out}"), 1000, 1000)
    hook(tree, "README", "these hooks checkpoint the job", 0o644)
    hook(tree, ".hidden", f"echo hidden >> {out}")
    hook(tree, "50-old.dpkg-old", f"echo old >> {out}")
    target = hook(tree, "60-target", f"echo target >> {out}")
    os.rename(target, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tree.path(f"{HOOKS_DIR}/60-link"))
    caplog.set_level(logging.DEBUG, "tpuboot.notices.hooks")
    hooks = find_hooks(tree)
    assert [h.name for h in hooks] == ["10-ok"]
    warned = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    d, refused = HOOKS_DIR, "refused (a hook runs as root)"

    def fix(name: str) -> str:
        return f"chown root:root {d}/{name} && chmod go-w {d}/{name}"

    assert warned == [
        f"notice hooks: {d}/20-world is world-writable; {refused}: {fix('20-world')}",
        f"notice hooks: {d}/30-group is group-writable; {refused}: {fix('30-group')}",
        f"notice hooks: {d}/40-user is owned by uid 1000, not root; {refused}: {fix('40-user')}",
        f"notice hooks: {d}/60-link is a symbolic link; {refused}: copy the file there",
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        f"notice hooks: {d}/README is not executable; skipped (a README?)"
    ]
    run_hooks(hooks, PREEMPTION, 25.0)
    assert out.read_text() == "ok\n"


def test_a_hook_directory_that_is_a_link_out_or_writable_by_others_runs_nothing(
    tmp_path: Path, caplog
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "10-x").write_text("#!/bin/sh\n")
    os.chmod(outside / "10-x", 0o755)
    root = Root(tmp_path / "root")
    root.path("/etc/tpuboot").mkdir(parents=True)
    os.symlink(outside, root.path(HOOKS_DIR, follow=False))
    assert find_hooks(root) == []
    os.unlink(root.path(HOOKS_DIR, follow=False))
    root.path(HOOKS_DIR).mkdir()
    os.chmod(root.path(HOOKS_DIR), 0o777)
    assert find_hooks(root) == []
    said = [r.getMessage() for r in caplog.records]
    assert (
        said[0]
        == f"notice hooks: {HOOKS_DIR} is a symbolic link; refused (a hook runs as root): make it a directory"
    )
    assert said[1].startswith(f"notice hooks: {HOOKS_DIR} is world-writable; refused, no hooks run")
    assert find_hooks(Root(tmp_path / "nothing")) == []  # no directory: no hooks, nothing said
    assert len(caplog.records) == 2


def test_a_hundred_hooks_all_run_in_order(tree: Root, tmp_path: Path) -> None:
    out = tmp_path / "out"
    names = [f"{n:03d}-hook" for n in range(100)]
    for name in reversed(names):
        hook(tree, name, f'echo "$(basename "$0")" >> {out}')
    results = run_hooks(find_hooks(tree), Notice(MAINTENANCE, True, "TERMINATE_ON_HOST_MAINTENANCE"), 120.0)
    assert [r.status for r in results] == [0] * 100
    assert out.read_text().split() == names


@pytest.fixture
def open_tree() -> Iterator[Root]:
    """A tree another user may traverse (tmp_path is root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="tpuboot-hooks-"))
    try:
        os.chmod(top, 0o755)
        (top / HOOKS_DIR.lstrip("/")).mkdir(parents=True, mode=0o755)
        for part in ("etc", "etc/tpuboot"):
            os.chmod(top / part, 0o755)
        yield Root(top)
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root")
def test_hooks_run_as_the_configured_user_with_its_groups(open_tree: Root) -> None:
    nobody = pwd.getpwnam("nobody")
    # the exit status carries what the hook saw: its uid, and whether it kept root's groups
    hook(open_tree, "10-who", 'test "$(id -G)" = "$(id -G nobody)" || exit 1; exit $(( $(id -u) % 256 ))')
    results = run_hooks(find_hooks(open_tree), PREEMPTION, 25.0, hook_user("nobody"))
    assert [r.status for r in results] == [nobody.pw_uid % 256]
    results = run_hooks(find_hooks(open_tree), PREEMPTION, 25.0, hook_user(None))
    assert [r.status for r in results] == [1]  # root's groups are not nobody's
    with pytest.raises(ValueError, match="no user 'no-such-user'"):
        hook_user("no-such-user")


def test_a_hook_user_the_host_lacks_turns_the_hooks_off_never_to_root(caplog) -> None:
    from tpuboot.config import NoticesConfig, parse_config
    from tpuboot.errors import ConfigError
    from tpuboot.wiring import notice_settings

    settings = notice_settings(NoticesConfig(hook_user="no-such-user"))
    assert settings.hooks is False
    said = caplog.records[-1].getMessage()
    assert said == "notices.hook_user: no user 'no-such-user' on this host; create it or leave it out; " + (
        "no notice hooks run"
    )
    assert notice_settings(NoticesConfig(hook_user="root")).hooks is True
    with pytest.raises(ConfigError, match=r"notices.hook_user: '-x' is not a user name"):
        parse_config("notices: {hook_user: '-x'}\n", "f.yaml")
    with pytest.raises(ConfigError, match=r"notices.hook_deadline"):
        parse_config("notices: {hook_deadline: 0}\n", "f.yaml")


def test_a_stop_kills_the_hook_running_and_starts_no_other(tree: Root, tmp_path: Path, caplog) -> None:
    from tpuboot.notices.hooks import Cancel

    running = tmp_path / "running"
    hook(tree, "10-hangs", f"touch {running}; exec sleep 1000")
    hook(tree, "20-never", f"touch {tmp_path / 'ran'}")
    cancel = Cancel()
    results: list[object] = []
    runner = threading.Thread(
        target=lambda: results.extend(run_hooks(find_hooks(tree), PREEMPTION, 600.0, cancel=cancel))
    )
    runner.start()
    wait_until(running.exists)
    cancel.cancel()
    runner.join(30)
    assert [(r.name, r.killed, r.stopping) for r in results] == [("10-hangs", True, True)]  # type: ignore[attr-defined]
    assert not (tmp_path / "ran").exists()
    assert "notice hook 10-hangs: killed: tpuboot is stopping" in caplog.text
