"""The shipped code needs no Python newer than 3.10 (Ubuntu 22.04's), checked statically by vermin.

Only Python 3.11 runs here, so a 3.11 name (``datetime.UTC``, ``tomllib``, ``asyncio.timeout``)
would pass every other test and still fail on Ubuntu 22.04. The check is tested on snippets of
each kind of newer use, so it cannot pass by checking nothing.
"""

from __future__ import annotations

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
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == f">={OLDEST}"
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
