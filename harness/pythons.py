"""Other Pythons on this machine: CPython 3.X found by its minor version, made runnable by anyone.

The library-matrix rows (scripts/test-matrix) run each system's own Python, and a guest runs
tpuboot's service on one (:mod:`harness.vm.pyguest`). Machines of this kind carry them as pyenv
versions (``$(pyenv root)/versions/3.X.Y``), built with a shared libpython that the binary finds
through an absolute rpath into root's home. That home is mode 0700, so a process of another user
(the tests that drop to ``nobody``) cannot start them: :func:`runnable_copy` copies the version's
prefix with the binary's rpath set to ``$ORIGIN/../lib`` (patchelf), which runs for any user and
from any place, a guest's tree included.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Prints what :class:`Interpreter` records, run by the interpreter itself.
PROBE = (
    "import platform, sys; "
    "print(sys.executable, platform.python_implementation(), platform.python_version(), sys.base_prefix, "
    "sep='\\n')"
)
#: Left out of a copy: the standard library's own test suite (70 MB), whatever was pip-installed
#: into the original (site-packages stays, empty) and the static libpython (30 MB).
NOT_COPIED = ("test", "libpython*.a")
COPY_STAMP = ".copied-from"


class InterpreterNotFound(RuntimeError):
    """No CPython of the wanted minor version here; the message says where it looked."""


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter as it reports itself."""

    executable: Path
    implementation: str
    version: str
    prefix: Path

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])

    def describe(self) -> str:
        """``CPython 3.10.13 (/path/bin/python3.10)``: what a row's header prints."""
        return f"{self.implementation} {self.version} ({self.executable})"


def probe(executable: Path | str) -> Interpreter | None:
    """What ``executable`` says it is, or None when it does not run."""
    try:
        done = subprocess.run(
            [str(executable), "-I", "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError:
        return None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 4:
        return None
    return Interpreter(Path(lines[0]), lines[1], lines[2], Path(lines[3]))


def pyenv_root() -> Path:
    """``pyenv root`` (pyenv on PATH), else ``$PYENV_ROOT``, else pyenv's default ``~/.pyenv``."""
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 and done.stdout.strip():
            return Path(done.stdout.strip())
    return Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.name))


def candidates(minor: str) -> tuple[list[Path], str]:
    """The executables that may be CPython ``minor``, best first, and where they were looked for."""
    versions = pyenv_root() / "versions"
    pattern = f"{minor}.*"
    found = [
        d / "bin" / f"python{minor}"
        for d in sorted(versions.glob(pattern), key=_version_key, reverse=True)
        if re.fullmatch(rf"{re.escape(minor)}\.\d+", d.name)
    ]
    on_path = shutil.which(f"python{minor}")
    if on_path:
        found.append(Path(on_path))
    return found, f"{versions}/{pattern} and python{minor} on PATH"


def find(minor: str) -> Interpreter:
    """The newest CPython ``minor`` (``"3.10"``) here: pyenv's versions first, then PATH."""
    paths, looked = candidates(minor)
    for path in paths:
        found = probe(path)
        if found and found.implementation == "CPython" and found.minor == minor:
            return found
    raise InterpreterNotFound(f"no CPython {minor}: looked in {looked}")


def rpath(executable: Path) -> str:
    """The binary's DT_RUNPATH/DT_RPATH ('' for none)."""
    done = subprocess.run(
        ["patchelf", "--print-rpath", str(executable)], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.strip()


def needs_copy(python: Interpreter) -> bool:
    """Whether the binary finds its libpython through an absolute rpath (pyenv's builds do)."""
    return any(part and not part.startswith("$ORIGIN") for part in rpath(python.executable).split(":"))


def _ignored(directory: str, names: list[str]) -> set[str]:
    ignored = {name for name in names for pattern in NOT_COPIED if Path(name).match(pattern)}
    if Path(directory).name == "site-packages":
        ignored.update(names)
    return ignored


def relocatable_copy(python: Interpreter, dest: Path) -> Interpreter:
    """A copy of ``python``'s prefix at ``dest`` that runs for any user and from any place.

    Reused while ``dest`` was made from the same interpreter (path and version); a copy cut short
    is made anew (it is built beside ``dest`` and renamed into place).
    """
    origin = f"{python.executable} {python.version}\n"
    stamp = dest / COPY_STAMP
    if not (stamp.is_file() and stamp.read_text() == origin):
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(python.prefix, tmp, symlinks=True, ignore=_ignored)
        binary = tmp / "bin" / python.executable.name
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN/../lib", str(binary)], check=True, timeout=60)
        (tmp / COPY_STAMP).write_text(origin)
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, dest)
    copied = probe(dest / "bin" / python.executable.name)
    if copied is None or copied.version != python.version:
        raise InterpreterNotFound(f"the copy of {python.describe()} at {dest} does not run")
    return copied


def runnable_copy(python: Interpreter, dest: Path) -> Interpreter:
    """``python`` itself when any user can run it where it is, else its relocatable copy at ``dest``."""
    return relocatable_copy(python, dest) if needs_copy(python) else python
