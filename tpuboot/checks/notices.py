"""Doctor's ``maintenance-notice``: is the host about to go away? Read from the file the daemon
keeps (/run/tpuboot/notice, :mod:`tpuboot.notices.noticefile`), never from the metadata server:
doctor says what the daemon, the hooks and `tpuboot wait-maintenance` see."""

from __future__ import annotations

from tpuboot.atomicfile import FileError
from tpuboot.config import Config
from tpuboot.notices import noticefile
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, passed, skipped, warned

#: A notice is a WARN, never a FAIL: the host is fine until it goes.
MAINTENANCE_NOTICE = Criterion(
    "maintenance-notice", "no maintenance or preemption notice from the metadata server (a WARN)"
)


def check_notice(root: Root, config: Config) -> CheckResult:
    """SKIP when nothing watches (off, or the daemon not running), PASS with no notice, WARN with one."""
    if not config.notices.enabled:
        return skipped("notices.enabled is false: nothing watches for maintenance or preemption")
    try:
        data = noticefile.load(root)
    except FileError as exc:
        return warned(str(exc), f"rm {noticefile.NOTICE_PATH} && systemctl restart tpuboot")
    if data is None:
        return skipped(
            f"no {noticefile.NOTICE_PATH}: tpuboot run is not running, or has not heard the server yet"
        )
    active = noticefile.active(data)
    if not active:
        return passed("no maintenance or preemption notice from the metadata server")
    said = "; ".join(noticefile.describe(n) for n in active)
    return warned(
        f"the host is going away: {said}", "checkpoint the job now (doc/notices.md); nothing to fix here"
    )
