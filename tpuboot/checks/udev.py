"""The image check of the accel udev rule: /dev/accel* (TPU v2 to v4, the kernel's accel driver)
open to every user."""

from __future__ import annotations

import fnmatch

from tpuboot.checks.parsers.files import layered, texts
from tpuboot.checks.parsers.udev import UDEV_RULES_DIRS, Rule, udev_rules
from tpuboot.paths import Root
from tpuboot.verdicts import Check, CheckResult, Criterion, failed, passed

TPUBOOT_UDEV_RULE = "70-tpuboot.rules"


def names_accel(rule: Rule) -> bool:
    """The rule matches the accel device nodes (``KERNEL=="accel*"`` or a pattern taking accel0)."""
    return any(
        fnmatch.fnmatchcase("accel0", pattern)
        for k, op, v in rule
        if k == "KERNEL" and op == "=="
        for pattern in v.split("|")
    )


def _grants_accel(rule: Rule) -> bool:
    removing = any(k == "ACTION" and op == "==" and v == "remove" for k, op, v in rule)
    mode = [v for k, op, v in rule if k == "MODE" and op in ("=", ":=")]
    return not removing and names_accel(rule) and mode[-1:] == ["0666"]


ACCEL_RULE = Criterion("accel-udev-rule", "a udev rule giving /dev/accel* mode 0666 (TPU v2 to v4)")


def check_accel_rule(root: Root) -> CheckResult:
    """/dev/accel* (TPU v2 to v4, the kernel's accel driver) open to every user."""
    for shown, text in texts(root, layered(root, UDEV_RULES_DIRS, "*.rules")):
        if any(_grants_accel(rule) for rule in udev_rules(text)):
            return passed(f"{shown} gives accel* mode 0666")
    return failed(
        "no udev rule gives accel* mode 0666",
        f'install tpuboot ({TPUBOOT_UDEV_RULE}) or put KERNEL=="accel*", MODE="0666" in /etc/udev/rules.d/',
    )


CHECKS: tuple[tuple[Criterion, Check], ...] = ((ACCEL_RULE, check_accel_rule),)
