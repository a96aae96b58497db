"""Each check declared once, by its Criterion beside its code (tpuboot/verdicts.py): doctor runs
every criterion declared under tpuboot/checks/, each once, in the order doc/operation.md's table
lists them, with what each holds a host to and whether it is advisory; a check declared twice,
declared and not run, or documented and not declared fails here."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tpuboot.checks
from tpuboot.checks.doctor import Doctor
from tpuboot.checks.image import IMAGE_CHECKS
from tpuboot.config import Config
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Checks, Criterion, passed

OPERATION = Path(__file__).resolve().parents[3] / "doc/operation.md"
#: A row of the table: the check's name in backticks, "(advisory)" for one that fails nothing,
#: and what it holds a host to.
ROW = re.compile(r"^\| `([\w-]+)`( \(advisory\))? \| (.+) \|$", re.MULTILINE)


def documented() -> list[tuple[str, bool, str]]:
    """(name, required, what it holds a host to) of each row of doc/operation.md's table; the
    page may put a path or a key in backticks."""
    text = OPERATION.read_text()
    assert "\n### What doctor holds a host to\n" in text
    part = text.split("\n### What doctor holds a host to\n", 1)[1].split("\n## ", 1)[0]
    return rows(part)


def rows(text: str) -> list[tuple[str, bool, str]]:
    return [(name, not advisory, holds.replace("`", "")) for name, advisory, holds in ROW.findall(text)]


def doctors() -> list[Criterion]:
    """The criteria of the checks doctor runs, in its order, with the default configuration."""
    return Doctor(Root(Path("/nonexistent")), Config()).checks.criteria


def declared() -> set[Criterion]:
    """Every Criterion a module under tpuboot/checks/ declares by name."""
    modules = [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(tpuboot.checks.__path__, "tpuboot.checks.")
    ]
    return {value for module in modules for value in vars(module).values() if isinstance(value, Criterion)}


def test_the_operation_page_lists_every_check_doctor_runs_as_declared():
    """Name, required or advisory, and the line: the page and the criteria say the same, in
    doctor's order (renamed, added or dropped in one, the other follows)."""
    criteria = doctors()
    assert len(criteria) > 40 and any(not c.required for c in criteria)
    assert documented() == [(c.name, c.required, c.holds) for c in criteria]


def test_every_criterion_declared_is_one_doctor_runs():
    found = declared()
    assert {"tpus-bound", "cmdline-idle-poll", "cdi-docker"} <= {c.name for c in found}
    assert sorted(c.name for c in found - set(doctors())) == []


def test_image_check_runs_a_run_of_doctors_checks():
    """image-check's table is doctor's, between the device checks and tpuboot's outputs."""
    names = [c.name for c in doctors()]
    start = names.index(IMAGE_CHECKS.names[0])
    assert names[start : start + len(IMAGE_CHECKS.names)] == IMAGE_CHECKS.names


def test_a_check_declared_twice_is_refused():
    """Two criteria of one name in a table, even saying different things, are one check too many."""

    def check(root: Root) -> CheckResult:
        return passed("ok")

    with pytest.raises(ValueError, match="check 'tpus-bound' is registered twice"):
        Checks(
            [
                (Criterion("tpus-bound", "one thing"), check),
                (Criterion("tpus-bound", "another", False), check),
            ]
        )


def test_the_table_rows_are_read():
    text = "| `a-b` | one `/path` |\n| `c` (advisory) | two |\n| not a row |"
    assert rows(text) == [
        ("a-b", True, "one /path"),
        ("c", False, "two"),
    ]
