"""The pure parts of bench/npd.py: its table's ratios to NPD's timeout and its verdict.

No root, no namespace: they run with ``-m "not vm"``.
"""

from __future__ import annotations

import argparse

from bench import npd as bench
from tpuboot.checks import npd


def args() -> argparse.Namespace:
    return argparse.Namespace(runs=3, load=2, processes=10, files=1)


def found(seconds: list[float]) -> dict[str, dict[str, object]]:
    return {c.name: {"seconds": seconds, "statuses": [0, 0, 1], "line": "ok"} for c in npd.CONDITIONS}


def test_every_rule_gets_a_row_with_its_ratio_to_the_timeout():
    lines = bench.report(found([0.2, 0.25, 0.3]), args())
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in npd.BY_NAME]
    assert [row.split()[0] for row in rows] == [c.name for c in npd.CONDITIONS]
    assert all(" 0.050 " in row and " 0,1 " in row for row in rows), rows  # 250 ms of 5 s; statuses
    assert lines[-1].endswith(": PASS")


def test_a_median_over_a_tenth_of_the_timeout_fails_the_goal():
    assert bench.report(found([0.6, 0.6, 0.6]), args())[-1].endswith(": FAIL")
