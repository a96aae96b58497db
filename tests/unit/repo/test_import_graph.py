"""No import cycle anywhere in tpuboot/: every ``import`` counts, at module level, inside a function
or under ``TYPE_CHECKING`` (a lazy edge never breaks an import, but it still ties two modules
together: loading one drags in the other, and neither can be understood alone).

Each module is parsed with ``ast``, never imported. An edge goes from a module to every tpuboot
module it names, ``from tpuboot.x import y`` to ``tpuboot.x.y`` when that is a module, else to
``tpuboot.x``; a package's ``__init__`` is the package's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "tpuboot"


def module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(top: Path) -> dict[str, Path]:
    return {module_name(path, top): path for path in sorted(top.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from`` import names (relative imports resolved against ``importer``)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(tree: ast.AST, importer: str, is_package: bool, known: set[str], top: str) -> set[str]:
    """The tpuboot modules ``tree`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    found.add(_nearest(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer, is_package)
            if not (base == top or base.startswith(top + ".")):
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else _nearest(base, known))
    found.discard(importer)
    return found


def _nearest(name: str, known: set[str]) -> str:
    """``name``, or its nearest enclosing package that is a module here."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def graph(top: Path) -> dict[str, set[str]]:
    found = modules(top)
    known = set(found)
    return {
        name: imports(
            ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", known, top.name
        )
        for name, path in found.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a cycle found in it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(_a_cycle(sorted(component), edges))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def _a_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module, for the failure message (breadth first)."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return component


def test_tpuboot_has_no_import_cycle() -> None:
    found = cycles(graph(PACKAGE))
    assert not found, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by a lazy import, one under TYPE_CHECKING and one by a
    relative import are each found; a module importing only itself or a package's own parent is not."""
    top = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    import pkg.a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import X\n",
        "d.py": "from pkg.c import Y\n",
        "sub/__init__.py": "from . import e\n",
        "sub/e.py": "from ..sub import f\n",
        "sub/f.py": "from .e import g\n",
        "alone.py": "import pkg.alone\nimport os\n",
    }
    for name, text in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)
    found = {frozenset(cycle) for cycle in cycles(graph(top))}
    assert found == {
        frozenset({"pkg.a", "pkg.b"}),
        frozenset({"pkg.c", "pkg.d"}),
        frozenset({"pkg.sub.e", "pkg.sub.f"}),
    }


@pytest.mark.parametrize("module", ["tpuboot.gce", "tpuboot.backoff"])
def test_the_gce_client_and_the_backoff_do_not_reach_the_config(module: str) -> None:
    """The metadata client takes plain settings: nothing under it reaches tpuboot.config, so the
    config's validators can use what they need of it without a cycle."""
    edges = graph(PACKAGE)
    start = [name for name in edges if name == module or name.startswith(module + ".")]
    seen, todo = set(start), list(start)
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert "tpuboot.config" not in seen


def test_no_test_module_imports_another() -> None:
    """What tests share lives in fixtures, fakes, helpers or harness/ (doc/testing.md), never in a
    test module: importing one runs its module-level code and ties two test files together."""
    edges = graph(PACKAGE.parent / "tests")

    def is_test(name: str) -> bool:
        return name.rsplit(".", 1)[-1].startswith("test_")

    found = sorted(
        f"{a} imports {b}" for a, targets in edges.items() if is_test(a) for b in targets if is_test(b)
    )
    assert not found, found


def packages(edges: dict[str, set[str]], top: str) -> dict[str, set[str]]:
    """The module graph folded to tpuboot's sub-packages (``tpuboot.devices``...); a top-level
    module (``tpuboot.cli``) stands for itself."""

    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else name

    folded: dict[str, set[str]] = {}
    for name, targets in edges.items():
        if name.startswith(top):
            here = package(name)
            folded.setdefault(here, set()).update(package(t) for t in targets if package(t) != here)
    return folded


def test_the_sub_packages_have_no_cycle() -> None:
    """Sub-packages layer (devices under holders under the checks...): a package that imports
    another which imports it back cannot be read, moved or tested alone (issue 32)."""
    found = cycles(packages(graph(PACKAGE), "tpuboot"))
    assert not found, "package cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


#: Docker's client, and who may import it: itself and the one place that chooses the host's engine.
DOCKER = {"tpuboot.containers.docker", "tpuboot.containers.dockerapi", "tpuboot.containers.dockerwire"}
DOCKER_SEAM = DOCKER | {"tpuboot.containers.hostengine"}


def test_only_the_host_engine_reaches_dockers_client() -> None:
    """A second engine is one client and one line in tpuboot/containers/hostengine.py: nothing
    else (the daemon, doctor, prepare-image, `release`) may name Docker's modules."""
    edges = graph(PACKAGE)
    assert set(edges) >= DOCKER, "Docker's modules moved: update DOCKER"
    assert {m for m, to in edges.items() if to & DOCKER and m not in DOCKER_SEAM} == set()
