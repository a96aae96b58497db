"""The shipped code needs no Python newer than 3.10 (Ubuntu 22.04's), checked statically by vermin,
and uses nothing 3.12 or 3.13 removed (they run on Ubuntu 24.04 and Debian 13); so does every
Python file a library-matrix row runs: tests/, harness/ and the bench/ modules they import.

The rows run the unit suite on 3.10, 3.12 and 3.13 (scripts/test-matrix), but only the lines the
tests take: a 3.11 name (``datetime.UTC``, ``tomllib``, ``asyncio.timeout``) on a path no test
takes would still fail on Ubuntu 22.04, and one in a test module stops the whole module from
being collected there. The check is tested on snippets of each kind of newer use, so it cannot
pass by checking nothing. It runs in the main run only: vermin is a main-run tool, and a static
verdict does not depend on the interpreter that reaches it.
"""

from __future__ import annotations

import ast
import configparser
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
OLDEST = "3.10"
VERMIN = "from vermin import main; raise SystemExit(main())"
#: What the rows run directly (their pytest collects tests/; tests and bench import harness/).
ROW_ROOTS = ("tests", "harness")


def vermin(*paths: Path) -> subprocess.CompletedProcess[str]:
    """vermin's verdict on ``paths``: exit status 1 and one line per use newer than OLDEST.

    Comments are not parsed (no ``# novermin`` escape hatch), annotations count as evaluated
    (config dataclasses may be introspected) and a syntax error counts as too new.
    """
    args = ["--no-tips", "--violations", "--no-parse-comments", "--eval-annotations", "--pessimistic"]
    if importlib.util.find_spec("vermin") is None:
        pytest.fail("vermin is missing; run scripts/setup-host (it installs scripts/test-requirements.txt)")
    return subprocess.run(
        [sys.executable, "-c", VERMIN, *args, f"--target={OLDEST}-", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def module_file(top: Path, dotted: str) -> Path | None:
    """The file under ``top`` that the absolute module name ``dotted`` is, if it is one of them."""
    base = top.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(path: Path, top: Path) -> set[Path]:
    """The files under ``top`` that ``path`` imports, lazily imported ones too."""
    found: set[Path] = set()
    package = ".".join(path.relative_to(top).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        found.update(f for name in names if name and (f := module_file(top, name)) is not None)
    return found


def files_run(roots: Iterable[Path], top: Path) -> list[Path]:
    """Every .py file under ``roots`` and every file of ``top`` they import, transitively."""
    todo = [f for root in roots for f in sorted(root.rglob("*.py"))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path, top) - seen)
    return sorted(seen)


def row_files() -> list[Path]:
    """The Python files a library-matrix row runs, besides tpuboot/."""
    return [
        f for f in files_run((REPO / root for root in ROW_ROOTS), REPO) if REPO / "tpuboot" not in f.parents
    ]


def test_the_shipped_code_needs_at_most_python_3_10() -> None:
    result = vermin(REPO / "tpuboot")
    assert result.returncode == 0, f"tpuboot/ uses Python newer than 3.10:\n{result.stdout}{result.stderr}"
    assert "Minimum required versions: 3." in result.stdout, result.stdout  # it analysed something


def test_what_the_rows_run_needs_at_most_python_3_10() -> None:
    files = row_files()
    result = vermin(*files)
    assert result.returncode == 0, f"these use Python newer than 3.10:\n{result.stdout}{result.stderr}"
    assert f"Analyzing {len(files)} files" in result.stdout, result.stdout


def test_the_rows_files_are_the_tests_the_harness_and_the_bench_modules_they_import() -> None:
    files = {f.relative_to(REPO).as_posix() for f in row_files()}
    assert {"tests/unit/env/test_sync.py", "harness/pythons.py", "harness/vm/guest/vfio_read.py"} <= files
    # Imported by tests (tests/unit/bench/) and by those modules in turn:
    assert {
        "bench/soak.py",
        "bench/soak_reader.py",
        "bench/table.py",
        "bench/idle.py",
        "bench/guest.py",
        "bench/peers.py",
    } <= files
    assert not [f for f in files if f.startswith("tpuboot/")]


def test_the_import_walk_follows_absolute_relative_and_lazy_imports(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from lib import one\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "__init__.py").write_text("")
    (tmp_path / "lib" / "one.py").write_text("def f():\n    from . import two\n")
    (tmp_path / "lib" / "two.py").write_text("import lib.three\n")
    (tmp_path / "lib" / "three.py").write_text("")
    (tmp_path / "lib" / "unused.py").write_text("import tomllib\n")
    found = {f.relative_to(tmp_path).as_posix() for f in files_run([tmp_path / "tests"], tmp_path)}
    assert found == {"tests/test_a.py", "lib/__init__.py", "lib/one.py", "lib/two.py", "lib/three.py"}


def toml_string(text: str, table: str, key: str) -> str:
    """The string ``key = "..."`` of ``[table]`` in pyproject.toml (tomllib is 3.11's)."""
    section = re.search(rf"^\[{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, f"no [{table}] table"
    value = re.search(rf'^{re.escape(key)}\s*=\s*"([^"]*)"', section.group(1), re.M)
    assert value, f"no {key} in [{table}]"
    return value.group(1)


def test_the_check_target_is_the_packages_python_floor() -> None:
    metadata = configparser.ConfigParser()
    metadata.read(REPO / "setup.cfg")
    assert metadata["options"]["python_requires"] == f">={OLDEST}"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert toml_string(pyproject, "tool.ruff", "target-version") == "py" + OLDEST.replace(".", "")
    assert toml_string(pyproject, "tool.mypy", "python_version") == OLDEST


TOO_NEW = {
    "datetime.UTC": "import datetime\nNOW = datetime.datetime.now(datetime.UTC)\n",
    "from datetime import UTC": "from datetime import UTC\n",
    "tomllib": "import tomllib\n",
    "enum.StrEnum": "import enum\n\nclass Kind(enum.StrEnum):\n    A = 'a'\n",
    "except*": "try:\n    pass\nexcept* ValueError:\n    pass\n",
    "asyncio.TaskGroup": "import asyncio\n\nasync def f():\n    async with asyncio.TaskGroup(): ...\n",
    "asyncio.timeout": "import asyncio\n\nasync def f():\n    async with asyncio.timeout(1): ...\n",
    "typing.Self": "from typing import Self\n",
    "typing.Self in a postponed annotation": (
        "from __future__ import annotations\nimport typing\n\ndef f() -> typing.Self: ...\n"
    ),
    "3.12 type statement": "type Pair = tuple[int, int]\n",
}


@pytest.mark.parametrize("snippet", TOO_NEW.values(), ids=TOO_NEW.keys())
def test_the_check_fails_on_each_kind_of_newer_use(snippet: str, tmp_path: Path) -> None:
    (tmp_path / "newer.py").write_text(snippet)
    result = vermin(tmp_path)
    assert result.returncode == 1, f"vermin passed a use newer than 3.10:\n{snippet}\n{result.stdout}"
    assert re.search(r"requires !2, 3\.1[1-9]", result.stdout), result.stdout


def test_the_check_passes_python_3_10_code(tmp_path: Path) -> None:
    """Its failures above come from the newer uses, not from the check failing on anything."""
    (tmp_path / "ok.py").write_text(
        "from __future__ import annotations\nimport datetime\n\n"
        "def now(zone: datetime.tzinfo | None = None) -> datetime.datetime:\n"
        "    match zone:\n        case None:\n            zone = datetime.timezone.utc\n"
        "    return datetime.datetime.now(zone)\n"
    )
    result = vermin(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- and nothing that newer Pythons removed (Ubuntu 24.04 runs 3.12, Debian 13 runs 3.13) -----

#: Modules and names gone in the Python given (PEP 594, PEP 632 and the 3.12/3.13 removals).
REMOVED = {
    **dict.fromkeys(("distutils", "imp", "asynchat", "asyncore", "smtpd"), "3.12"),
    **dict.fromkeys(("ssl.wrap_socket", "ssl.match_hostname", "configparser.SafeConfigParser"), "3.12"),
    "locale.format": "3.12",
    **dict.fromkeys(("unittest.findTestCases", "unittest.makeSuite"), "3.13"),
    **dict.fromkeys(("typing.io", "typing.re", "locale.resetlocale", "lib2to3", "tkinter.tix"), "3.13"),
    **dict.fromkeys(
        ("aifc", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "mailcap", "msilib", "nis"), "3.13"
    ),
    **dict.fromkeys(
        ("nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd", "sunau", "telnetlib", "uu", "xdrlib"), "3.13"
    ),
}


def removed_uses(path: Path) -> list[str]:
    """``file:line name (removed in 3.x)`` for each import or module attribute listed in REMOVED."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def check(name: str, node: ast.stmt | ast.expr) -> None:
        for candidate in (name, name.rsplit(".", 1)[0]):
            if candidate in REMOVED:
                found.append(f"{path.name}:{node.lineno} {name} (removed in {REMOVED[candidate]})")
                return

    modules: dict[str, str] = {}  # local name -> module, from every import (lazy ones too)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                modules[local] = alias.name if alias.asname else local
                check(alias.name, node)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                check(f"{node.module}.{alias.name}", node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            check(f"{modules[node.value.id]}.{node.attr}", node)
    return found


def test_the_shipped_code_and_what_the_rows_run_use_nothing_python_3_12_or_3_13_removed() -> None:
    files = [*sorted((REPO / "tpuboot").rglob("*.py")), *row_files()]
    found = [use for path in files for use in removed_uses(path)]
    assert not found, "replace these, gone in newer Pythons:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import distutils.util\n",
        "from imp import reload\n",
        "import ssl\nssl.wrap_socket(None)\n",
        "import ssl as s\ns.wrap_socket(None)\n",
        "from typing import io\n",
        "import pipes\n",
        "from configparser import SafeConfigParser\n",
    ],
)
def test_the_removal_check_finds_each_kind_of_use(snippet: str, tmp_path: Path) -> None:
    (tmp_path / "old.py").write_text(snippet)
    assert removed_uses(tmp_path / "old.py")
