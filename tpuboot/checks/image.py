"""Which of the settings a TPU OS image needs are in force (``tpuboot image-check``): the kernel
(:mod:`tpuboot.checks.kernel`: its command line, vfio-pci, transparent huge pages), memlock and
nofile limits for logins, services and container runtimes (:mod:`tpuboot.checks.limits`), the
accel udev rule (:mod:`tpuboot.checks.udev`), and the documented procedure's files left in the
image that would fight tpuboot (:mod:`tpuboot.checks.leftovers`).

Each check reads files through a Root, so it runs the same on the host, against an image tree
(``--root``) and on a test's temporary tree. ``run_checks(next_boot=True)`` (prepare-image)
judges the next boot even on a running system. This module only puts the subjects' tables
together, in run order.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpuboot.checks import kernel, leftovers, limits, udev
from tpuboot.checks.parsers.systemd import Systemd
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Checks

IMAGE_CHECKS = Checks([*kernel.CHECKS, *limits.CHECKS, *udev.CHECKS, *leftovers.CHECKS])

#: The same checks judging the next boot (``prepare-image`` on a build VM, whose own boot is not
#: the image's): :data:`tpuboot.checks.kernel.NEXT_BOOT`'s variants in place of the kernel checks.
NEXT_BOOT_CHECKS = IMAGE_CHECKS.with_overrides(kernel.NEXT_BOOT)


def image_checks(*, next_boot: bool = False, systemd: Systemd | None = None) -> Checks:
    """The image checks (doctor runs them among its own).

    ``next_boot`` (``tpuboot prepare-image``): judge what the next boot gets even on a running
    system (the command line update-grub will write, the installed kernels), not what is in
    force now. ``systemd``: who answers ``systemctl show`` (default: systemctl itself, on the host)."""
    checks = NEXT_BOOT_CHECKS if next_boot else IMAGE_CHECKS
    return checks if systemd is None else checks.with_overrides(limits.limit_checks(systemd))


def run_checks(
    root: Root, only: Sequence[str] = (), *, next_boot: bool = False, systemd: Systemd | None = None
) -> list[CheckResult]:
    """The image checks against ``root`` (``tpuboot image-check``); ``only``: name patterns;
    ``next_boot`` and ``systemd`` as :func:`image_checks` takes them."""
    checks = image_checks(next_boot=next_boot, systemd=systemd)
    return checks.run(root, checks.select(only) if only else None)
