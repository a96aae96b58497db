"""Doctor's PCIe health check: every TPU function's link and error counters, judged by
:func:`tpuboot.devices.health.judge` (one rule for what is degraded, wherever it is shown)."""

from __future__ import annotations

from collections.abc import Sequence

from tpuboot.devices.health import judge, read_healths
from tpuboot.devices.survey import TpuStatus
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, failed, passed, skipped, warned

PCIE_HEALTH = Criterion(
    "pcie-health", "every TPU function on the bus, no fatal AER error, no link at half its bandwidth or less"
)


def check_pcie_health(root: Root, tpus: Sequence[TpuStatus]) -> CheckResult:
    """FAIL on a function gone from the bus, a fatal AER error or a link at half its bandwidth or
    less; WARN on non-fatal errors since boot or a link below its best."""
    if not tpus:
        return skipped("no TPU on this machine")
    health = read_healths(root, (t.address for t in tpus))
    findings = [f for t in tpus for f in judge(health[t.address])]
    fails = [f for f in findings if f.level == "FAIL"]
    if fails:
        return failed("; ".join(f.detail for f in fails), fails[0].fix)
    if findings:
        return warned("; ".join(f.detail for f in findings), findings[0].fix)
    return passed(f"{len(tpus)} TPU function(s): present, links at their best, no uncorrectable PCIe errors")
