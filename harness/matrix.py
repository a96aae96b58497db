"""The library matrix: each supported system's Python minor version and library versions.

``scripts/matrix/ROW.txt`` pins one system's versions of tpuboot's run-time libraries (and, through
``tools.txt``, the test tools, pinned per Python with environment markers); this module says which
Python each row runs on. scripts/test-matrix runs the unit suite once per row on that Python; the
main run (scripts/test) is the bookworm row, on Debian 12's own python3 and python3-* packages;
:mod:`harness.vm.pyguest` installs a row's libraries on its Python for tpuboot's service in a guest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MATRIX = Path(__file__).resolve().parents[1] / "scripts" / "matrix"
#: tpuboot's run-time dependencies, by their distribution names on PyPI (grpcio: the optional one,
#: a Recommends of the package, for libtpu's runtime metrics).
LIBRARIES = ("PyYAML", "requests", "urllib3", "pyudev", "systemd-python", "prometheus-client", "grpcio")


@dataclass(frozen=True)
class Row:
    """One system: its name (the requirement file's), what it is, and its Python minor version."""

    name: str
    system: str
    python: str

    @property
    def requirements(self) -> Path:
        return MATRIX / f"{self.name}.txt"

    def pins(self) -> dict[str, str]:
        """{distribution: version} of the row's own ``name==version`` lines (not the tools')."""
        found = {}
        for line in self.requirements.read_text().splitlines():
            name, sep, version = line.split("#")[0].strip().partition("==")
            if sep:
                found[name] = version
        return found


ROWS = (
    Row("jammy", "Ubuntu 22.04", "3.10"),
    Row("noble", "Ubuntu 24.04", "3.12"),
    Row("bookworm", "Debian 12", "3.11"),
    Row("trixie", "Debian 13", "3.13"),
)
#: The row the main run is: the host's own Python and python3-* packages (not built by pip).
MAIN_ROW = "bookworm"


def row_named(name: str) -> Row:
    """The row called ``name``."""
    for row in ROWS:
        if row.name == name:
            return row
    raise ValueError(f"no library-matrix row {name!r}; use one of {', '.join(r.name for r in ROWS)}")
