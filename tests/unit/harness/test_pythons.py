"""harness/pythons.py: another CPython found by minor version, and copied so any user can run it.

The library-matrix rows and the jammy-userland guest stand on these: a wrong interpreter found,
or a copy another user cannot start, would make a row test something else than it says.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from harness import pythons
from harness.matrix import Row

IS_ROOT = os.geteuid() == 0


def fake_python(path: Path, version: str, implementation: str = "CPython") -> Path:
    """An executable that answers PROBE as the interpreter ``version`` at ``path`` would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = path.parent.parent
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' '{path}' {implementation} {version} '{prefix}'\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def pyenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pyenv root, with no pyenv and no python3.X on PATH."""
    root = tmp_path / "pyenv"
    (root / "versions").mkdir(parents=True)
    monkeypatch.setenv("PYENV_ROOT", str(root))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return root


def test_the_newest_patch_release_of_the_minor_version_is_found(pyenv: Path) -> None:
    for version in ("3.10.9", "3.10.13", "3.1.4", "3.100.1", "3.11.7"):
        fake_python(pyenv / "versions" / version / "bin" / f"python{version.rsplit('.', 1)[0]}", version)
    found = pythons.find("3.10")
    assert (found.version, found.executable) == ("3.10.13", pyenv / "versions/3.10.13/bin/python3.10")
    assert found.describe() == f"CPython 3.10.13 ({pyenv}/versions/3.10.13/bin/python3.10)"


def test_a_version_directory_that_is_not_what_it_says_is_passed_over(pyenv: Path, tmp_path: Path) -> None:
    fake_python(pyenv / "versions/3.10.13/bin/python3.10", "3.11.7")  # lies about its version
    fake_python(pyenv / "versions/3.10.12/bin/python3.10", "3.10.12", implementation="PyPy")
    fake_python(tmp_path / "bin" / "python3.10", "3.10.6")
    found = pythons.find("3.10")
    assert (found.version, found.executable) == ("3.10.6", tmp_path / "bin" / "python3.10")


def test_a_missing_python_is_one_line_saying_where_it_looked(pyenv: Path) -> None:
    fake_python(pyenv / "versions/3.12.1/bin/python3.12", "3.12.1")
    with pytest.raises(pythons.InterpreterNotFound) as caught:
        pythons.find("3.10")
    assert str(caught.value) == f"no CPython 3.10: looked in {pyenv}/versions/3.10.* and python3.10 on PATH"


def matrix_script() -> ModuleType:
    """scripts/test-matrix, loaded as a module (it has no .py suffix; its dataclasses look their
    module up in sys.modules)."""
    path = Path(__file__).resolve().parents[3] / "scripts" / "test-matrix"
    loader = importlib.machinery.SourceFileLoader("test_matrix_script", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = module
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("ci", ["true", None])
def test_a_rows_missing_python_fails_under_ci_and_is_said_loudly_elsewhere(
    pyenv: Path, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    script = matrix_script()
    row = Row("jammy", "Ubuntu 22.04", "3.10")
    where = f"no CPython 3.10: looked in {pyenv}/versions/3.10.* and python3.10 on PATH"
    if ci:
        monkeypatch.setenv("CI", ci)
        with pytest.raises(script.RowError) as caught:
            script.row_python(row)
        assert str(caught.value) == f"{where} (CI=true: each row runs on its own Python)"
        return
    monkeypatch.delenv("CI", raising=False)
    chosen = script.row_python(row)
    assert chosen.interpreter.version == platform.python_version()  # the host's: this one
    assert chosen.describe().endswith(f" INSTEAD OF ITS OWN ({where})")
    assert chosen.short().endswith(" instead of 3.10")
    assert "INSTEAD OF ITS OWN" in script.heading(row, chosen.describe())


def test_debians_own_python_is_used_where_it_is() -> None:
    """No absolute rpath: any user can start it, so no copy is made."""
    system = pythons.probe("/usr/bin/python3")
    assert system is not None
    assert not pythons.needs_copy(system)
    assert pythons.runnable_copy(system, Path("/nonexistent")) is system


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """A folder another user can reach (pytest's tmp_path is under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="tpuboot-pythons-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.skipif(not IS_ROOT, reason="needs root, to run the copy as nobody")
def test_a_pyenv_build_is_copied_with_a_relative_rpath_and_runs_for_nobody(world_readable_dir: Path) -> None:
    try:
        original = pythons.find("3.10")
    except pythons.InterpreterNotFound as exc:
        pytest.skip(str(exc))
    if not pythons.needs_copy(original):
        pytest.skip(f"{original.describe()} finds its libpython without an absolute rpath")
    copy = pythons.relocatable_copy(original, world_readable_dir / "3.10")
    assert (copy.version, copy.prefix) == (original.version, world_readable_dir / "3.10")
    assert pythons.rpath(copy.executable) == "$ORIGIN/../lib"
    assert not (copy.prefix / "lib/python3.10/test").exists()
    assert list((copy.prefix / "lib/python3.10/site-packages").iterdir()) == []
    done = subprocess.run(
        [str(copy.executable), "-c", "import ssl, ctypes, sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, original.version), done.stderr
    # The same interpreter again: the copy is kept (its stamp says where it came from).
    stamp = copy.prefix / pythons.COPY_STAMP
    before = stamp.stat().st_mtime_ns
    pythons.relocatable_copy(original, world_readable_dir / "3.10")
    assert stamp.stat().st_mtime_ns == before
