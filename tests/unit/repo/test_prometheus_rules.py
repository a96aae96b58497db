"""The Prometheus rules shipped in prometheus/: `promtool check rules` clean, their promtool unit
tests passing, every alert tested firing and not firing, every record tested, and every metric
name they use one that tpuboot declares (tpuboot/metrics_catalog.py) and so exports.

promtool comes with Debian's prometheus package (scripts/host-packages.txt); without it these
tests fail, saying so, rather than skip: CI must run them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tpuboot.metrics_catalog import CATALOG

TOP = Path(__file__).resolve().parents[3]
RULES = TOP / "prometheus/tpuboot.rules.yml"
RULE_TESTS = sorted((TOP / "prometheus/tests").glob("*.yml"))
# A metric name where PromQL expects one: not the tail of a record name (level:metric:ops).
TPUBOOT_NAME = re.compile(r"(?<![\w:])tpuboot_\w+(?![\w:])")
SERIES_NAME = re.compile(r"^\s*([a-zA-Z_:][\w:]*)")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package (scripts/setup-host does)")
    return path


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules() -> list[dict[str, Any]]:
    return [rule for group in load(RULES)["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    """Every series name tpuboot exports: each declared metric's sample names (the exposition
    shows each declared metric and no other: tests/unit/test_metrics_catalog.py)."""
    return {sample for metric in CATALOG for sample in metric.samples}


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120, cwd=TOP)


def test_promtool_check_rules_is_clean():
    done = run([promtool(), "check", "rules", str(RULES)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass():
    assert RULE_TESTS, "no promtool tests in prometheus/tests"
    done = run([promtool(), "test", "rules", *map(str, RULE_TESTS)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(RULE_TESTS), done.stdout


def test_every_alert_is_tested_firing_and_not_firing():
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for case in load(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts, RULES
    assert {"untested firing": alerts - firing, "untested silent": alerts - silent} == {
        "untested firing": set(),
        "untested silent": set(),
    }


def test_every_record_is_tested():
    tested = {
        check["expr"].strip()
        for path in RULE_TESTS
        for case in load(path)["tests"]
        for check in case.get("promql_expr_test", [])
        if check.get("exp_samples")
    }
    records = {rule["record"] for rule in rules() if "record" in rule}
    assert records, RULES
    assert records - tested == set()


def test_rules_and_their_tests_use_only_metrics_tpuboot_exports():
    exported = exported_names()
    assert "tpuboot_tpus" in exported and "tpuboot_bind_duration_seconds_bucket" in exported
    in_rules = {name for rule in rules() for name in TPUBOOT_NAME.findall(rule["expr"])}
    assert len(in_rules) >= 5, in_rules  # the pattern finds what it should
    in_tests = set()
    for path in RULE_TESTS:
        for case in load(path)["tests"]:
            for series in case.get("input_series", []):
                match = SERIES_NAME.match(series["series"])
                assert match, series
                if match.group(1).startswith("tpuboot_"):
                    in_tests.add(match.group(1))
    assert {"rules": in_rules - exported, "tests": in_tests - exported} == {"rules": set(), "tests": set()}


@pytest.mark.parametrize(
    ("expr", "found"),
    [
        ("sum(tpuboot_tpus{state='bound'})", {"tpuboot_tpus"}),
        ("rate(tpuboot_bind_attempts_total[5m])", {"tpuboot_bind_attempts_total"}),
        ("instance:tpuboot_tpus_bound:sum > 0", set()),
        ("sum by (slice) (instance:tpuboot_tpus_bound:sum) + tpuboot_nope", {"tpuboot_nope"}),
    ],
)
def test_metric_names_are_read_from_expressions(expr, found):
    assert set(TPUBOOT_NAME.findall(expr)) == found
