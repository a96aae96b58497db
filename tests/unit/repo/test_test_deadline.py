"""tests/conftest.py's deadline, on a pytest of its own: a test that hangs past it fails with its
stack printed, and the run goes on (xdist) or stops (no workers), instead of hanging; SIGUSR2
(scripts/test's budget) prints the stacks and ends nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.helpers.runproc import REPO

HANGING = """
import threading

def test_hangs():
    threading.Event().wait()  # nothing sets it: only the deadline ends this

def test_after():
    pass
"""
SIGNALLED = """
import os, signal

def test_signalled():
    os.kill(os.getpid(), signal.SIGUSR2)
"""
#: Seconds: a bound on the inner run, so that a broken deadline fails this test, not the whole run.
INNER_RUN_BOUND_S = 300


def inner_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with only tests/conftest.py as plugin, on one file holding ``source``, deadline 1 s."""
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["TPUBOOT_TEST_DEADLINE"] = "1"
    plugins = ["-p", "tests.conftest", "-p", "no:cacheprovider"]
    command = [sys.executable, "-m", "pytest", *plugins, "-c", os.devnull, "--rootdir", str(tmp_path), *args]
    try:
        return subprocess.run([*command, str(test_file)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=INNER_RUN_BOUND_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the hanging test was not ended by its deadline")


def test_a_hang_fails_its_test_with_the_stack_and_the_workers_go_on(tmp_path: Path) -> None:
    run = inner_pytest(tmp_path, HANGING, "-n", "1")
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "Timeout (0:00:01)!" in output
    assert "in test_hangs" in output  # the hung test's frame, in the dump
    assert "worker 'gw0' crashed while running 'test_inner.py::test_hangs'" in output
    assert "1 failed, 1 passed" in output


def test_without_workers_a_hang_stops_the_run_with_the_stack(tmp_path: Path) -> None:
    run = inner_pytest(tmp_path, HANGING, "-p", "no:xdist")
    assert run.returncode != 0
    assert "Timeout (0:00:01)!" in run.stderr
    assert "in test_hangs" in run.stderr


def test_a_test_within_its_deadline_is_untouched(tmp_path: Path) -> None:
    run = inner_pytest(tmp_path, HANGING, "-p", "no:xdist", "-k", "test_after")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Timeout" not in run.stderr


def test_sigusr2_prints_the_stacks_and_ends_nothing(tmp_path: Path) -> None:
    run = inner_pytest(tmp_path, SIGNALLED, "-p", "no:xdist")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "in test_signalled" in run.stderr
