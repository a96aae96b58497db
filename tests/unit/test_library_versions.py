"""The library matrix runs what it claims: each row imports exactly its distribution's versions.

scripts/test-matrix sets TPUBOOT_LIBRARY_ROW for the jammy, noble and trixie venvs, and
scripts/test sets it to bookworm for the main run, whose .venv sees the host's python3-*
packages; a pip-installed test tool that pulled in a newer requests there would show up here.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

MATRIX = Path(__file__).resolve().parents[2] / "scripts" / "matrix"
ROWS = ("jammy", "noble", "bookworm", "trixie")
#: tpuboot's run-time dependencies, by their distribution names on PyPI.
LIBRARIES = ("PyYAML", "requests", "urllib3", "pyudev", "systemd-python", "prometheus-client")
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
