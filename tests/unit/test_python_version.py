"""The shipped code needs no Python newer than 3.10 (Ubuntu 22.04's), checked statically by vermin,
and uses nothing 3.12 or 3.13 removed (they run on Ubuntu 24.04 and Debian 13).

Only Python 3.11 runs here, so a 3.11 name (``datetime.UTC``, ``tomllib``, ``asyncio.timeout``)
would pass every other test and still fail on Ubuntu 22.04. The check is tested on snippets of
each kind of newer use, so it cannot pass by checking nothing.
"""

from __future__ import annotations

import ast
import configparser
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
OLDEST = "3.10"
VERMIN = "from vermin import main; raise SystemExit(main())"


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


def test_the_shipped_code_needs_at_most_python_3_10() -> None:
    result = vermin(REPO / "tpuboot")
    assert result.returncode == 0, f"tpuboot/ uses Python newer than 3.10:\n{result.stdout}{result.stderr}"
    assert "Minimum required versions: 3." in result.stdout, result.stdout  # it analysed something


def test_the_check_target_is_the_packages_python_floor() -> None:
    metadata = configparser.ConfigParser()
    metadata.read(REPO / "setup.cfg")
    assert metadata["options"]["python_requires"] == f">={OLDEST}"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["ruff"]["target-version"] == "py" + OLDEST.replace(".", "")


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


def test_the_shipped_code_uses_nothing_python_3_12_or_3_13_removed() -> None:
    found = [use for path in sorted((REPO / "tpuboot").rglob("*.py")) for use in removed_uses(path)]
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
