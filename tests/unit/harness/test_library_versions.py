"""The library matrix runs what it claims: each row imports exactly its distribution's versions,
on its system's Python minor version.

scripts/test-matrix sets TPUBOOT_LIBRARY_ROW for the jammy, noble and trixie venvs, and
scripts/test sets it to bookworm for the main run, whose .venv sees the host's python3 and
python3-* packages; a pip-installed test tool that pulled in a newer requests there would show up
here. Off CI, scripts/test-matrix runs a row whose Python is missing on the host's, says so in the
row's header, and sets TPUBOOT_ROW_PYTHON_SUBSTITUTE=1, which turns the Python check into a skip.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest

from harness.matrix import LIBRARIES, MATRIX, row_named
from harness.matrix import ROWS as MATRIX_ROWS

ROWS = tuple(row.name for row in MATRIX_ROWS)
PIN = re.compile(r"([A-Za-z0-9._-]+)==([0-9][A-Za-z0-9.+-]*)\Z")


def requirement_lines(path: Path) -> list[str]:
    return [
        line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()
    ]


def pins(path: Path) -> dict[str, str]:
    """{distribution: version} of ``path`` and the files it includes."""
    found: dict[str, str] = {}
    for line in requirement_lines(path):
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:].strip()))
        elif match := PIN.match(line):
            found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("row", ROWS)
def test_each_row_pins_every_run_time_library_exactly(row: str) -> None:
    path = MATRIX / f"{row}.txt"
    loose = [line for line in requirement_lines(path) if not line.startswith("-r ") and not PIN.match(line)]
    assert not loose, f"{path.name}: pin each line as name==version (rows install with --no-deps): {loose}"
    missing = [lib for lib in LIBRARIES if lib not in pins(path)]
    assert not missing, f"{path.name}: add the row's version of {', '.join(missing)}"


def test_jammy_row_carries_six_for_its_pyudev() -> None:
    """pyudev 0.22 imports six; Ubuntu 22.04's python3-pyudev depends on python3-six."""
    assert pins(MATRIX / "jammy.txt")["pyudev"] == "0.22.0"
    assert "six" in pins(MATRIX / "jammy.txt")


ROW = os.environ.get("TPUBOOT_LIBRARY_ROW")


@pytest.mark.skipif(
    ROW is None, reason="not a library-matrix run (scripts/test and scripts/test-matrix set it)"
)
def test_this_run_imports_its_rows_versions() -> None:
    assert ROW in ROWS, f"TPUBOOT_LIBRARY_ROW={ROW!r}; use one of {', '.join(ROWS)}"
    wanted = pins(MATRIX / f"{ROW}.txt")
    found = {lib: importlib.metadata.version(lib) for lib in LIBRARIES}
    assert found == {lib: wanted[lib] for lib in LIBRARIES}


@pytest.mark.skipif(
    ROW is None, reason="not a library-matrix run (scripts/test and scripts/test-matrix set it)"
)
def test_this_run_is_on_its_systems_python() -> None:
    wanted = row_named(str(ROW)).python
    if os.environ.get("TPUBOOT_ROW_PYTHON_SUBSTITUTE") == "1":
        pytest.skip(f"no Python {wanted} here: scripts/test-matrix ran this row on {sys.version.split()[0]}")
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == wanted
