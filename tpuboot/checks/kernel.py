"""The image checks of the kernel: the TPU parameters on its command line (:mod:`tpuboot.kernel_params`),
vfio-pci in it, and transparent huge pages in force.

The command line judged is the running kernel's (``/proc/cmdline``) on a running system, and on a
tree the one its next boot gets from the GRUB defaults (:mod:`tpuboot.checks.parsers.grub`); the
next-boot variants (:data:`NEXT_BOOT`, for prepare-image) judge the next boot on a running system
too. A fact that exists only on a running system (sysfs) is SKIP where it is absent, not FAIL.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tpuboot.atomicfile import read_file
from tpuboot.checks.parsers.cmdline import Param, kernel_params
from tpuboot.checks.parsers.files import read_text
from tpuboot.checks.parsers.grub import GRUB_DEFAULT, GRUB_DROPIN_DIR, TPUBOOT_DROPIN, Unreadable, next_boot
from tpuboot.devices.kmodule import NO_VFIO_PCI_FIX, in_kernel, installed_releases, module_state
from tpuboot.kernel_params import TPU_PARAMS, X86, word
from tpuboot.paths import Root
from tpuboot.verdicts import Check, CheckResult, Criterion, failed, passed, skipped, warned


def kernel_arch(root: Root) -> str:
    """The running kernel's architecture (``/proc/sys/kernel/arch``; the host's if unreadable)."""
    text = read_text(root, "/proc/sys/kernel/arch")
    return text.strip() if text else os.uname().machine


def image_arch(root: Root) -> str:
    """The image's architecture: dpkg's (``/var/lib/dpkg/arch``, else the kernel's)."""
    text = read_text(root, "/var/lib/dpkg/arch")
    words = (text or "").split()
    return words[0] if words else kernel_arch(root)


@dataclass(frozen=True)
class Cmdline:
    """A kernel command line to judge and what it is (shown in the detail)."""

    params: list[Param]
    what: str


def _running_cmdline(root: Root) -> list[Param] | None:
    """``/proc/cmdline`` as the kernel parsed it, or None on a tree that is not running."""
    data = read_file(root, "/proc/cmdline")
    return None if data is None else kernel_params(data)


def running_or_next(root: Root) -> Cmdline | CheckResult:
    """The running kernel's command line on a running system; on a tree (no /proc/cmdline), the
    one its next boot gets (``image-check --root``)."""
    params = _running_cmdline(root)
    if params is not None:
        return Cmdline(params, "kernel command line")
    return next_boot_cmdline(root)


def next_boot_cmdline(root: Root) -> Cmdline | CheckResult:
    """What update-grub will generate from the GRUB defaults (``prepare-image``, ``--root``);
    SKIP without a GRUB configuration, WARN when a file is shell tpuboot does not evaluate."""
    try:
        boot = next_boot(root, image_arch(root))
        if boot is None:
            return skipped(f"no {GRUB_DEFAULT} nor {GRUB_DROPIN_DIR}/*.cfg: not booted by GRUB, cannot tell")
        return Cmdline(boot.params(), "next boot's command line (update-grub)")
    except Unreadable as exc:
        return warned(f"cannot tell the next boot's command line: {exc}", "see the detail")


CmdlineSource = Callable[[Root], "Cmdline | CheckResult"]


def intel_iommu_ok(values: Sequence[str | None]) -> bool:
    """Options accumulate over every intel_iommu= in order; the last on/off and sm_on/sm_off win."""
    on = scalable = False
    for value in values:
        for option in (value or "").split(","):
            if option in ("on", "off"):
                on = option == "on"
            elif option in ("sm_on", "sm_off"):
                scalable = option == "sm_on"
    return on and scalable


def param_ok(name: str, values: Sequence[str | None]) -> bool:
    """Whether the values TPU parameter ``name`` has on a command line, in order, give the kernel
    what the TPU runtime needs: the last one wins (intel_iommu's options accumulate)."""
    if name == "intel_iommu":
        return intel_iommu_ok(values)
    return list(values[-1:]) == [TPU_PARAMS[name][0]]


def cmdline_fix(param: str, root: Root) -> str:
    if root.path(TPUBOOT_DROPIN).exists():
        return f"{TPUBOOT_DROPIN} adds {param} unless {GRUB_DEFAULT} sets it: fix that, update-grub, reboot"
    return f"add {param} to the kernel command line: install tpuboot (its GRUB drop-in), update-grub, reboot"


def _cmdline_check(root: Root, name: str, source: CmdlineSource) -> CheckResult:
    """TPU parameter ``name`` as the command line ``source`` gives has it: every value, in order."""
    line = source(root)
    if isinstance(line, CheckResult):
        return line
    want = word(name)
    values = [param.value for param in line.params if param.name == name]
    if param_ok(name, values):
        return passed(f"{line.what} has {want}")
    found = " ".join(f"{name}={v}" if v is not None else name for v in values) or f"no {name}="
    return failed(f"{line.what} lacks {want} ({found})", cmdline_fix(want, root))


IDLE_POLL = Criterion("cmdline-idle-poll", f"{word('idle')} on the kernel command line")


def check_idle_poll(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    """idle=poll: CPUs never enter low-power idle states (latency)."""
    return _cmdline_check(root, "idle", source)


THP_CMDLINE = Criterion(
    "cmdline-transparent-hugepage", f"{word('transparent_hugepage')} on the kernel command line"
)


def check_thp_cmdline(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    return _cmdline_check(root, "transparent_hugepage", source)


INTEL_IOMMU = Criterion("cmdline-intel-iommu", f"{word('intel_iommu')} on the kernel command line (x86_64)")


def check_intel_iommu(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    """intel_iommu=on,sm_on: the IOMMU in scalable mode, which vfio-pci needs (x86_64 only)."""
    machine = kernel_arch(root) if source is running_or_next else image_arch(root)
    if machine not in X86:
        return skipped(f"not needed on {machine}")
    return _cmdline_check(root, "intel_iommu", source)


VFIO_PCI_IN_KERNEL = Criterion(
    "vfio-pci-in-kernel", "vfio-pci built into the kernel or shipped as its module"
)


def check_vfio_pci_in_kernel(root: Root, installed: bool = False) -> CheckResult:
    """vfio-pci built in (Ubuntu) or shipped as a module (Debian): the running kernel on a running
    system, else (or with ``installed``, for the next boot) every kernel under /lib/modules of the
    image. Not whether it is loaded (that is the doctor's): tpuboot loads a module when it binds,
    and a built-in one needs nothing."""
    if not installed and root.path("/proc/sys/kernel/osrelease").exists():
        states = [module_state(root, "vfio-pci")]
    else:
        states = [in_kernel(root, release, "vfio-pci") for release in installed_releases(root)]
    if not states:
        return skipped("no kernel under /lib/modules: cannot tell")
    unknown = [s for s in states if s.origin == "unknown"]
    if len(unknown) == len(states):
        return skipped(f"cannot tell: {unknown[0].evidence}")
    absent = [s for s in states if s.origin == "absent"]
    if absent:
        which = ", ".join(s.release or "the running kernel" for s in absent)
        return failed(f"no vfio-pci in {which}, neither built in nor as a module", NO_VFIO_PCI_FIX)
    how = {"built-in": "built into", "loaded": "loaded in", "loadable": "a module of"}
    known = [s for s in states if s.origin in how]
    return passed("vfio-pci " + "; ".join(f"{how[s.origin]} {s.release} ({s.evidence})" for s in known))


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
THP = Criterion("thp-enabled", "transparent huge pages always, in the running kernel")


def check_thp_enabled(root: Root) -> CheckResult:
    """What the kernel does now, whatever the command line said."""
    text = read_text(root, THP_ENABLED)
    if text is None:
        return skipped(f"no {THP_ENABLED}: not a running system, or a kernel without THP")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text.strip()
    if mode == "always":
        return passed("transparent huge pages: always")
    return failed(
        f"transparent huge pages: {mode}",
        f"echo always > {THP_ENABLED} now; {word('transparent_hugepage')} on the kernel command line "
        "for every boot",
    )


def _thp_next_boot(root: Root) -> CheckResult:
    return skipped(f"set at boot by transparent_hugepage= (see {THP_CMDLINE.name})")


CHECKS: tuple[tuple[Criterion, Check], ...] = (
    (IDLE_POLL, check_idle_poll),
    (THP_CMDLINE, check_thp_cmdline),
    (INTEL_IOMMU, check_intel_iommu),
    (VFIO_PCI_IN_KERNEL, check_vfio_pci_in_kernel),
    (THP, check_thp_enabled),
)

#: The same checks judging the next boot (``prepare-image`` on a build VM, whose own boot is not
#: the image's): the command line from the GRUB defaults, every installed kernel, THP by its
#: command-line parameter only.
NEXT_BOOT: dict[Criterion, Check] = {
    IDLE_POLL: lambda root: check_idle_poll(root, next_boot_cmdline),
    THP_CMDLINE: lambda root: check_thp_cmdline(root, next_boot_cmdline),
    INTEL_IOMMU: lambda root: check_intel_iommu(root, next_boot_cmdline),
    VFIO_PCI_IN_KERNEL: lambda root: check_vfio_pci_in_kernel(root, installed=True),
    THP: _thp_next_boot,
}
