"""The image checks of resource limits: memlock and nofile for logins (pam_limits), for every
service (systemd's defaults) and for the container runtimes' units, whose containers inherit
them. Where the root is the host and systemd runs, the limits are taken from ``systemctl show``
(what is in force, not only what the files say); elsewhere from the unit and drop-in files,
resolved as systemd does (:mod:`tpuboot.checks.parsers.systemd`)."""

from __future__ import annotations

import dataclasses

from tpuboot.checks.parsers.pam import PAM_LIMITS_DIR, pam_limit
from tpuboot.checks.parsers.rlimits import UNLIMITED, Limit
from tpuboot.checks.parsers.systemd import (
    SYSTEMD,
    Systemd,
    file_limits,
    manager_files,
    parse_rlimit,
    unit_dropins,
    unit_file,
)
from tpuboot.paths import Root
from tpuboot.verdicts import Check, CheckResult, Criterion, failed, passed, skipped

MIN_NOFILE = 100_000
ITEMS = {"memlock": UNLIMITED, "nofile": MIN_NOFILE}  # what the TPU runtime needs of each
WANT = {"memlock": "unlimited", "nofile": str(MIN_NOFILE)}
PAM_DROPIN = "/etc/security/limits.d/tpuboot.conf"
#: The container engines' daemons and their units, whose limits their containers inherit.
DOCKER_UNIT, CONTAINERD_UNIT = "docker.service", "containerd.service"
ENGINES = (("dockerd", DOCKER_UNIT), ("containerd", CONTAINERD_UNIT))
MANAGER_DROPIN = "/usr/lib/systemd/system.conf.d/50-tpuboot.conf"


def _judge(what: str, limits: dict[str, Limit], fix: str) -> CheckResult:
    detail = f"{what}: " + ", ".join(f"{item} {limit}" for item, limit in limits.items())
    if all(limit.at_least(ITEMS[item]) for item, limit in limits.items()):
        return passed(detail)
    return failed(f"{detail}; need memlock unlimited and nofile >= {MIN_NOFILE}", fix)


# PAM (pam_limits): logins only.


def _pam_check(root: Root, item: str) -> CheckResult:
    limits = {user: pam_limit(root, user, item) for user in ("*", "root")}
    detail = f"PAM {item}: " + "; ".join(f"{user} {limit}" for user, limit in limits.items())
    if all(limit.at_least(ITEMS[item]) for limit in limits.values()):
        return passed(detail)
    want = WANT[item]
    return failed(
        f"{detail}; need {want} for both",
        f"install tpuboot ({PAM_DROPIN}) or add '* - {item} {want}' and 'root - {item} {want}' "
        f"to a file in {PAM_LIMITS_DIR}/",
    )


PAM_MEMLOCK = Criterion("pam-memlock", f"memlock {WANT['memlock']} for logins (PAM limits)")


def check_pam_memlock(root: Root) -> CheckResult:
    """Locked-memory limit for logins: libtpu's "Couldn't mmap" otherwise."""
    return _pam_check(root, "memlock")


PAM_NOFILE = Criterion("pam-nofile", f"nofile at least {WANT['nofile']} for logins (PAM limits)")


def check_pam_nofile(root: Root) -> CheckResult:
    return _pam_check(root, "nofile")


# systemd: services, and the containers the container runtimes start.


def _keys(prefix: str) -> dict[str, str]:
    """systemd's setting for each item: ``{prefix}MEMLOCK`` -> ``memlock``."""
    return {f"{prefix}{item.upper()}": item for item in ITEMS}


def _shown_limits(
    systemd: Systemd, unit: str | None, prefix: str, extra: tuple[str, ...] = ()
) -> tuple[dict[str, Limit], dict[str, str]] | None:
    """The limits ``systemctl show`` reports (hard ``{prefix}X``, soft ``{prefix}XSoft``)."""
    names = [f"{prefix}{item.upper()}{soft}" for item in ITEMS for soft in ("", "Soft")]
    shown = systemd.show(unit, [*names, *extra])
    if shown is None:
        return None
    limits = {}
    for item in ITEMS:
        hard, soft = shown.get(f"{prefix}{item.upper()}", ""), shown.get(f"{prefix}{item.upper()}Soft", "")
        try:
            limits[item] = parse_rlimit(f"{soft or hard}:{hard}", "systemctl show")
        except ValueError:
            limits[item] = Limit(None, None, f"systemctl show says {soft}:{hard}")
    return limits, shown


def manager_limits(root: Root, systemd: Systemd = SYSTEMD) -> dict[str, Limit]:
    """systemd's default limits for every service that does not set its own."""
    if systemd.live(root) and (live := _shown_limits(systemd, None, "DefaultLimit")) is not None:
        return live[0]
    limits = file_limits(root, manager_files(root), "Manager", _keys("DefaultLimit"))
    return {item: limit or Limit(None, None, "systemd's built-in default") for item, limit in limits.items()}


BOTH = f"memlock {WANT['memlock']} and nofile at least {WANT['nofile']}"
MANAGER_LIMITS = Criterion("systemd-default-limits", f"{BOTH} for every service (systemd's defaults)")


def check_manager_limits(root: Root, systemd: Systemd = SYSTEMD) -> CheckResult:
    """Every service's limits unless its unit sets its own: PAM limits never reach services."""
    fix = (
        f"install tpuboot ({MANAGER_DROPIN}) or set DefaultLimitMEMLOCK=infinity and "
        f"DefaultLimitNOFILE={MIN_NOFILE} in /etc/systemd/system.conf.d/, then reboot"
    )
    return _judge("systemd defaults", manager_limits(root, systemd), fix)


def unit_limits(root: Root, unit: str, systemd: Systemd = SYSTEMD) -> dict[str, Limit] | None:
    """A service's memlock and nofile limits; None if the unit is not installed (or masked)."""
    if systemd.live(root) and (live := _shown_limits(systemd, unit, "Limit", ("LoadState",))) is not None:
        limits, shown = live
        return limits if shown.get("LoadState") == "loaded" else None
    path = unit_file(root, unit)
    if path is None:
        return None
    own = file_limits(root, [path, *unit_dropins(root, unit)], "Service", _keys("Limit"))
    default = manager_limits(root, systemd)
    return {
        item: limit or dataclasses.replace(default[item], source=f"default: {default[item].source}")
        for item, limit in own.items()
    }


DOCKER_LIMITS = Criterion("docker-limits", f"{BOTH} in {DOCKER_UNIT}, which its containers inherit")
CONTAINERD_LIMITS = Criterion(
    "containerd-limits", f"{BOTH} in {CONTAINERD_UNIT}, which its containers inherit"
)


def _runtime_check(unit: str, systemd: Systemd) -> Check:
    def check(root: Root) -> CheckResult:
        limits = unit_limits(root, unit, systemd)
        if limits is None:
            return skipped(f"{unit} is not installed")
        fix = (
            f"install tpuboot (/usr/lib/systemd/system/{unit}.d/50-tpuboot.conf) or set "
            f"LimitMEMLOCK=infinity and LimitNOFILE={MIN_NOFILE} in /etc/systemd/system/{unit}.d/, "
            f"daemon-reload, restart {unit}"
        )
        return _judge(unit, limits, fix)

    check.__doc__ = f"{unit}'s limits, which its containers inherit."
    return check


def limit_checks(systemd: Systemd) -> dict[Criterion, Check]:
    """The checks that ask ``systemd`` what is in force, by criterion."""
    return {
        MANAGER_LIMITS: lambda root: check_manager_limits(root, systemd),
        DOCKER_LIMITS: _runtime_check(DOCKER_UNIT, systemd),
        CONTAINERD_LIMITS: _runtime_check(CONTAINERD_UNIT, systemd),
    }


CHECKS: tuple[tuple[Criterion, Check], ...] = (
    (PAM_MEMLOCK, check_pam_memlock),
    (PAM_NOFILE, check_pam_nofile),
    *limit_checks(SYSTEMD).items(),
)
