"""The check framework: a verdict (:class:`CheckResult`), what a check holds a host to
(:class:`Criterion`) and a run-ordered table of checks (:class:`Checks`), shared by
``tpuboot image-check``, ``prepare-image`` and ``tpuboot doctor``.

A check is a function of a :class:`~tpuboot.paths.Root`, declared by its :class:`Criterion`
beside its code: its name, whether a FAIL of it fails doctor, and what it holds a host to, once.
Every registry is built the same way, from a table of ``(criterion, check)`` pairs written where
its checks are put together (image.py's :data:`~tpuboot.checks.image.IMAGE_CHECKS`, the doctor's
constructor), so the run order is read in one place. A check that holds its root already
(doctor's, made for one system) joins a table through :func:`holding_root`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
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


@dataclass(frozen=True)
class Criterion:
    """One check, declared beside its code: ``name`` (what the commands print and ``--only``
    matches), what it ``holds`` a host to (one line; doc/operation.md's table says the same), and
    whether a FAIL of it fails doctor (``required``) or is reported only (advisory)."""

    name: str
    holds: str
    required: bool = True


Check = Callable[[Root], CheckResult]
#: A table of checks: each one's criterion and function, in run order.
Named = Iterable[tuple[Criterion, Check]]


def holding_root(
    named: Iterable[tuple[Criterion, Callable[[], CheckResult]]],
) -> list[tuple[Criterion, Check]]:
    """Checks bound to their system already (methods of an object holding the root), as a table
    of :data:`Check` wants them: the root they are run with is the one they hold."""
    return [(criterion, _ignoring_root(check)) for criterion, check in named]


def _ignoring_root(check: Callable[[], CheckResult]) -> Check:
    return lambda root: check()


class Checks:
    """Named checks, run in the order of their table; each result carries its check's name."""

    def __init__(self, named: Named = ()) -> None:
        self._checks: dict[str, tuple[Criterion, Check]] = {}
        for criterion, func in named:
            if criterion.name in self._checks:
                raise ValueError(f"check {criterion.name!r} is registered twice")
            self._checks[criterion.name] = (criterion, func)

    @property
    def names(self) -> list[str]:
        return list(self._checks)

    @property
    def table(self) -> list[tuple[Criterion, Check]]:
        """The ``(criterion, check)`` pairs, in run order (for a larger table)."""
        return list(self._checks.values())

    @property
    def criteria(self) -> list[Criterion]:
        return [criterion for criterion, _ in self._checks.values()]

    def __getitem__(self, name: str) -> Check:
        """Check ``name`` itself, which raises what it raises (:meth:`run` makes that a FAIL)."""
        return self._checks[name][1]

    def select(self, patterns: Sequence[str]) -> list[str]:
        """The names matching any of ``patterns`` (shell-style: ``leftover-*``), in run order; a
        pattern matching none is a UsageError."""
        for pattern in patterns:
            if not fnmatch.filter(self._checks, pattern):
                raise UsageError(f"no check named {pattern!r}; the names are {', '.join(self._checks)}")
        return [name for name in self._checks if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    def with_overrides(self, overrides: Mapping[Criterion, Check]) -> Checks:
        """A copy in the same order, with the checks of the criteria in ``overrides`` replaced."""
        unknown = set(overrides) - set(self.criteria)
        if unknown:
            raise ValueError(f"no check named {', '.join(sorted(c.name for c in unknown))}")
        return Checks((criterion, overrides.get(criterion, func)) for criterion, func in self.table)

    def run(self, root: Root, names: Sequence[str] | None = None) -> list[CheckResult]:
        """Every check's result (or those in ``names``); a check that cannot read what it needs
        FAILs alone."""
        results = []
        for name, (_, func) in self._checks.items():
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
