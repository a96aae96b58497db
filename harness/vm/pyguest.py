"""A library-matrix row's Python and libraries in a guest: tpuboot's service on, say, Ubuntu
22.04's CPython 3.10 with jammy's library versions, on the Debian 12 guest's kernel and systemd.

The guest is Debian 12 (glibc 2.36, the host's own), so pyenv's build of the row's CPython runs
there as copied by :func:`harness.pythons.relocatable_copy` (rpath ``$ORIGIN/../lib``). The copy's
site-packages gets the row's own pins (its system's libraries, none of the test tools), built by
pip with ``--no-deps --no-build-isolation`` as scripts/test-matrix builds the row's venv, and
tpuboot as a link to the .deb's ``/usr/lib/python3/dist-packages/tpuboot``: the code that runs is
the package's. A drop-in points the unit's ExecStart at that interpreter; everything else of the
unit (Type=notify, the sandbox, the ordering) is the package's.

The built prefix is cached like the other artifacts (``python/<row>-<key>/`` in the cache),
keyed by the interpreter, the row's requirement files and the source of the functions that build it.
"""

from __future__ import annotations

from pathlib import Path

from harness import pythons
from harness.matrix import MATRIX, Row

from . import hostenv
from .artifacts import InstallHook, _building, _digest, _prune, _source, _timed, in_tree, remove_tree
from .hostenv import HostError, run
from .tpuboot_guest import write_in_tree

#: Where the .deb puts tpuboot's package (Debian's and Ubuntu's python3 path for every version).
PACKAGE_DIR = "/usr/lib/python3/dist-packages/tpuboot"
DROP_IN = "/etc/systemd/system/tpuboot.service.d/row-python.conf"


def guest_prefix(row: Row) -> str:
    """Where the row's Python lives in the guest: ``/opt/tpuboot-py310`` for jammy."""
    return f"/opt/tpuboot-py{row.python.replace('.', '')}"


def guest_python(row: Row) -> str:
    """The row's interpreter in the guest."""
    return f"{guest_prefix(row)}/bin/python{row.python}"


def site_packages(prefix: Path, row: Row) -> Path:
    return prefix / "lib" / f"python{row.python}" / "site-packages"


def _build(tmp: Path, row: Row, python: pythons.Interpreter) -> None:
    """The relocatable interpreter at ``tmp/prefix`` with the row's libraries in its site-packages."""
    tmp.mkdir()
    prefix = pythons.relocatable_copy(python, tmp / "prefix").prefix
    builder = tmp / "build-venv"  # setuptools and wheel for the sdists, kept out of the prefix
    run([prefix / "bin" / f"python{row.python}", "-m", "venv", builder], timeout=300)
    pip = [builder / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps"]
    run([*pip, "-r", MATRIX / "build.txt"], timeout=600)
    pins = [f"{name}=={version}" for name, version in row.pins().items()]
    run([*pip, "--no-build-isolation", "--target", site_packages(prefix, row), *pins], timeout=900)
    remove_tree(builder)


def ensure_row_python(row: Row, cache: Path | None = None) -> Path:
    """The prefix to copy into a guest: the row's CPython with the row's libraries (cached).

    InterpreterNotFound when this host has no CPython of the row's minor version (the message
    says where it looked).
    """
    python = pythons.find(row.python)
    parent = (cache or hostenv.cache_dir()) / "python"
    key = _digest(
        str(python.executable),
        python.version,
        row.requirements.read_bytes(),
        (MATRIX / "build.txt").read_bytes(),
        _source(_build, pythons.relocatable_copy, pythons._ignored),
        repr(pythons.NOT_COPIED),
    )
    final = parent / f"{row.name}-{key}"
    if not final.is_dir():
        with _timed(f"{row.name}'s Python {python.version} with its libraries"), _building(final) as tmp:
            _build(tmp, row, python)
        _prune(parent, final, row.name)
    return final / "prefix"


def drop_in(row: Row) -> str:
    return f"""[Service]
# tpuboot on {row.system}'s Python ({row.python}) with its library versions (harness/vm/pyguest.py).
ExecStart=
ExecStart={guest_python(row)} -I -m tpuboot run
"""


def with_row_python(install: InstallHook, row: Row, prefix: Path) -> InstallHook:
    """``install`` (which installs the .deb), then the row's ``prefix`` (from ensure_row_python)
    at :func:`guest_prefix`, tpuboot linked into it, and the unit's ExecStart pointed at it."""

    def hook(tree: Path) -> None:
        install(tree)
        if not in_tree(tree, PACKAGE_DIR).is_dir():
            raise HostError(f"the install hook left no {PACKAGE_DIR} for the row's Python to run")
        dest = in_tree(tree, guest_prefix(row))
        dest.parent.mkdir(parents=True, exist_ok=True)
        run(["cp", "-a", prefix, dest], timeout=300)
        (site_packages(dest, row) / "tpuboot").symlink_to(PACKAGE_DIR)
        write_in_tree(tree, DROP_IN, drop_in(row))

    return hook
