"""tpuboot uses only the public API of its run-time libraries: their private names change between
the versions it supports (prometheus_client's ``_get_best_family`` is in 0.14 and later, not in
Ubuntu 22.04's 0.9, and importing it stopped the daemon at start there).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TPUBOOT = Path(__file__).resolve().parents[3] / "tpuboot"
LIBRARIES = ("pyudev", "yaml", "requests", "urllib3", "systemd", "prometheus_client", "six", "grpc")


def _library(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def private_uses(path: Path) -> list[str]:
    """``file:line name`` for each private module or name of a library that ``path`` imports or reads."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    modules: dict[str, str] = {}  # local name -> library module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _library(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
                    if _private(alias.name):
                        found.append(f"{path.name}:{node.lineno} {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _library(node.module):
            for alias in node.names:
                if _private(f"{node.module}.{alias.name}"):
                    found.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
                else:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{path.name}:{node.lineno} {modules[base.id]}...{node.attr}")
    return found


def test_tpuboot_uses_no_private_library_name() -> None:
    found = [use for path in sorted(TPUBOOT.rglob("*.py")) for use in private_uses(path)]
    assert not found, "use the libraries' public API instead of:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "from prometheus_client.exposition import _get_best_family\n",
        "from pyudev._os import poll\n",
        "import urllib3\nurllib3.util._private\n",
        "import prometheus_client.exposition as e\ne._SilentHandler\n",
        "def f():\n    from systemd import journal\n    return journal._valid_field_name\n",
    ],
)
def test_the_check_finds_each_kind_of_private_use(snippet: str, tmp_path: Path) -> None:
    (tmp_path / "private.py").write_text(snippet)
    assert private_uses(tmp_path / "private.py")


def test_the_check_passes_public_uses(tmp_path: Path) -> None:
    (tmp_path / "public.py").write_text(
        "import yaml\nfrom systemd import daemon as _sd\nfrom prometheus_client import make_wsgi_app\n"
        "yaml.safe_load('a: 1')\n_sd.notify('READY=1')\nmake_wsgi_app().__call__\n"
    )
    assert private_uses(tmp_path / "public.py") == []
