"""The check framework: a verdict (:class:`CheckResult`) and a run-ordered table of named checks
(:class:`Checks`), shared by ``tpuboot image-check``, ``prepare-image`` and ``tpuboot doctor``.

A check is a function of a :class:`~tpuboot.paths.Root`. Every registry is built the same way,
from a table of ``(name, check)`` pairs written where its checks are put together (image.py's
:data:`~tpuboot.checks.image.IMAGE_CHECKS`, the doctor's constructor), so the run order is read
in one place. A check that holds its root already (doctor's, made for one system) joins a table
through :func:`holding_root`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tpuboot.errors import LinkLoop, TpubootError, UsageError, loop_fix
from tpuboot.paths import Root

Status = Literal["PASS", "FAIL", "SKIP", "WARN"]


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict. ``fix`` is a one-line instruction, given for a FAIL."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def passed(detail: str) -> CheckResult:
    return CheckResult("", "PASS", detail)


def failed(detail: str, fix: str) -> CheckResult:
    return CheckResult("", "FAIL", detail, fix)


def skipped(detail: str) -> CheckResult:
    return CheckResult("", "SKIP", detail)


def warned(detail: str, fix: str = "") -> CheckResult:
    """Judged, with a doubt that fails nothing (a value tpuboot's tables do not know, a leftover
    that duplicates what tpuboot sets); ``fix`` says how to clear it."""
    return CheckResult("", "WARN", detail, fix)


Check = Callable[[Root], CheckResult]
#: A table of checks: each one's name and function, in run order.
Named = Iterable[tuple[str, Check]]


def holding_root(named: Iterable[tuple[str, Callable[[], CheckResult]]]) -> list[tuple[str, Check]]:
    """Checks bound to their system already (methods of an object holding the root), as a table
    of :data:`Check` wants them: the root they are run with is the one they hold."""
    return [(name, _ignoring_root(check)) for name, check in named]


def _ignoring_root(check: Callable[[], CheckResult]) -> Check:
    return lambda root: check()


class Checks:
    """Named checks, run in the order of their table; each result carries its check's name."""

    def __init__(self, named: Named = ()) -> None:
        self._checks: dict[str, Check] = {}
        for name, func in named:
            if name in self._checks:
                raise ValueError(f"check {name!r} is registered twice")
            self._checks[name] = func

    @property
    def names(self) -> list[str]:
        return list(self._checks)

    def __getitem__(self, name: str) -> Check:
        """Check ``name`` itself, which raises what it raises (:meth:`run` makes that a FAIL)."""
        return self._checks[name]

    def select(self, patterns: Sequence[str]) -> list[str]:
        """The names matching any of ``patterns`` (shell-style: ``leftover-*``), in run order; a
        pattern matching none is a UsageError."""
        for pattern in patterns:
            if not fnmatch.filter(self._checks, pattern):
                raise UsageError(f"no check named {pattern!r}; the names are {', '.join(self._checks)}")
        return [name for name in self._checks if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    def with_overrides(self, overrides: dict[str, Check]) -> Checks:
        """A copy in the same order, with the checks named in ``overrides`` replaced."""
        unknown = set(overrides) - set(self._checks)
        if unknown:
            raise ValueError(f"no check named {', '.join(sorted(unknown))}")
        return Checks((name, overrides.get(name, func)) for name, func in self._checks.items())

    def run(self, root: Root, names: Sequence[str] | None = None) -> list[CheckResult]:
        """Every check's result (or those in ``names``); a check that cannot read what it needs
        FAILs alone."""
        results = []
        for name, func in self._checks.items():
            if names is not None and name not in names:
                continue
            try:
                result = func(root)
            except LinkLoop as exc:
                result = failed(f"cannot read: {exc.problem}", loop_fix(exc))
            except (OSError, UnicodeDecodeError, TpubootError) as exc:
                result = failed(f"cannot read: {exc}", "run as root, or fix the file's permissions")
            results.append(dataclasses.replace(result, name=name))
        return results
