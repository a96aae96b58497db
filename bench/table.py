"""The bench's report: rows of tpuboot against its baseline and its peer, their ratios and verdicts,
and the table printed (and written as Markdown) at the end of a run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# In the order of the table.
FAMILIES = ("hotplug", "cdi", "coldplug", "cli", "icount", "idle", "fleet", "holders", "slice")


@dataclass
class Row:
    """One line of the final table; ``ratio`` is tpuboot / baseline where both exist, ``peer_ratio``
    tpuboot / the peer tool (driverctl, google-guest-agent) measured in the same guest."""

    metric: str
    tpuboot: str
    baseline: str
    ratio: float | None = None
    goal: str = "(info)"
    verdict: str = ""
    peer: str = ""
    peer_ratio: float | None = None
    peer_goal: str = ""
    peer_verdict: str = ""

    def against(self, name: str, shown: str, ratio: float | None, goal: float | None = None) -> Row:
        """This row with the peer ``name``'s figure, its ratio and, with a goal, the verdict."""
        self.peer, self.peer_ratio = f"{name}: {shown}", ratio
        if goal is not None:
            self.peer_goal = f"<= {goal:g}x"
            self.peer_verdict = "n/a" if ratio is None else ("PASS" if ratio <= goal else "FAIL")
        return self

    def at_most(self, name: str, shown: str, ours: float, theirs: float) -> Row:
        """This row against a peer's count (ticks, wakeups, MiB): met when ours <= theirs, even at 0."""
        self.peer, self.peer_ratio = f"{name}: {shown}", ours / theirs if theirs > 0 else None
        self.peer_goal, self.peer_verdict = "<= 1x", "PASS" if ours <= theirs else "FAIL"
        return self


@dataclass
class Report:
    rows: dict[str, list[Row]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def add(self, family: str, row: Row) -> None:
        self.rows.setdefault(family, []).append(row)

    def note(self, family: str, text: str) -> None:
        self.notes.setdefault(family, []).append(text)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def spread(values: Sequence[float]) -> str:
    """``median [min-max]`` in seconds, for the table."""
    if not values:
        return "n/a"
    return f"{median(values):.3f} s [{min(values):.3f}-{max(values):.3f}]"


def median_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float | None:
    return median(ours) / median(theirs) if ours and theirs and median(theirs) > 0 else None


def ratio_row(
    metric: str, tp: Sequence[float], base: Sequence[float], goal: float | None = None, aim: str = ""
) -> Row:
    """A timing row: medians, their ratio and, with a goal, the verdict on that ratio."""
    ratio = median(tp) / median(base) if tp and base and median(base) > 0 else None
    if goal is None:
        return Row(metric, spread(tp), spread(base), ratio)
    verdict = "n/a" if ratio is None else ("PASS" if ratio <= goal else "FAIL")
    return Row(metric, spread(tp), spread(base), ratio, f"<= {goal:g}x{aim}", verdict)


def insn(values: Sequence[float]) -> str:
    """Guest seconds under ``-icount shift=0`` as millions of instructions, ``median [min-max]``."""
    if not values:
        return "n/a"
    return f"{median(values) * 1e3:.0f} M [{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}]"


def insn_row(metric: str, ours: Sequence[float], base: Sequence[float]) -> Row:
    return Row(metric, insn(ours), insn(base), median_ratio(ours, base))


def safe_ratio(ours: float, base: float) -> float | None:
    return ours / base if base and not math.isnan(base) and not math.isnan(ours) else None


def print_table(report: Report) -> None:
    header = ("metric", "tpuboot", "baseline", "ratio", "goal", "verdict", "peer", "ratio", "goal", "verdict")
    rows = [r for f in FAMILIES for r in report.rows.get(f, [])]
    lines = [table_cells(r) for r in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    print()
    for line in [header, tuple("-" * w for w in widths), *lines]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    print()
    for family in FAMILIES:
        for note in report.notes.get(family, []):
            print(f"* {family}: {note}")


def table_cells(r: Row) -> tuple[str, ...]:
    """A row's cells: metric, tpuboot, the documented baseline (ratio, goal, verdict), the peer (same)."""

    def ratio(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}x"

    return (r.metric, r.tpuboot, r.baseline, ratio(r.ratio), r.goal, r.verdict,
            r.peer, ratio(r.peer_ratio), r.peer_goal, r.peer_verdict)  # fmt: skip


def markdown_table(report: Report) -> str:
    """The table as Markdown, for the README."""
    lines = [
        "| metric | tpuboot | documented | ratio | goal | verdict | peer | ratio | goal | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for f in FAMILIES for r in report.rows.get(f, [])):
        cells = [c.replace("|", "/") for c in table_cells(r)]
        metric = cells[0].strip()
        cells[0] = f"&nbsp;&nbsp;{metric}" if r.metric.startswith(" ") else metric
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
