"""Which of the settings a TPU OS image needs are in force: the kernel command line, vfio-pci in
the kernel, transparent huge pages, memlock/nofile limits for logins, services and container
runtimes, the accel udev rule; and the documented procedure's files left in the image that would
fight tpuboot (the ``leftover-*`` checks).

Each check reads files through a Root, so it runs the same on the host, against an image tree
(``--root``) and on a test's temporary tree. A fact that exists only on a running system
(sysfs) is SKIP where it is absent, not FAIL. The kernel command line is the running kernel's
(``/proc/cmdline``) on a running system, and on a tree the one its next boot gets from the GRUB
defaults (:mod:`tpuboot.checks.nextboot`); ``run_checks(next_boot=True)`` (prepare-image) judges
the next boot on a running system too. Where the root is the host and
systemd runs, the limits are taken from ``systemctl show`` (what is in force, not only what the
files say); elsewhere from the unit and drop-in files, resolved as systemd does.

Checks are plain functions registered in a :class:`Checks`: ``tpuboot doctor`` can make its own
registry, or reuse these functions, and report with the same :class:`CheckResult`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from tpuboot import subproc
from tpuboot.atomicfile import read_file
from tpuboot.checks.cmdline import Param, kernel_params
from tpuboot.checks.nextboot import GRUB_DROPIN_DIR, X86, Unreadable, next_boot
from tpuboot.config import DEFAULT_ENVIRONMENT
from tpuboot.devices.kmodule import NO_VFIO_PCI_FIX, in_kernel, installed_releases, module_state
from tpuboot.devices.vfio import IOMMU_PARAM
from tpuboot.errors import TpubootError, UsageError
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


Check = Callable[[Root], CheckResult]
CheckT = TypeVar("CheckT", bound=Callable[..., CheckResult])


class Checks:
    """Named checks, run in the order they were added; each result carries its check's name."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}

    def add(self, name: str) -> Callable[[CheckT], CheckT]:
        """Decorator: register ``func`` as the check ``name`` (its own signature kept: a check
        may take more arguments with defaults, as the next-boot variants pass)."""

        def register(func: CheckT) -> CheckT:
            if name in self._checks:
                raise ValueError(f"check {name!r} is registered twice")
            self._checks[name] = func
            return func

        return register

    @property
    def names(self) -> list[str]:
        return list(self._checks)

    def select(self, patterns: Sequence[str]) -> list[str]:
        """The names matching any of ``patterns`` (shell-style: ``leftover-*``), in run order; a
        pattern matching none is a UsageError."""
        for pattern in patterns:
            if not fnmatch.filter(self._checks, pattern):
                raise UsageError(f"no check named {pattern!r}; the names are {', '.join(self._checks)}")
        return [name for name in self._checks if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    def with_overrides(self, overrides: dict[str, Check]) -> Checks:
        """A copy in the same order, with the checks named in ``overrides`` replaced."""
        unknown = set(overrides) - set(self._checks)
        if unknown:
            raise ValueError(f"no check named {', '.join(sorted(unknown))}")
        copy = Checks()
        copy._checks = {name: overrides.get(name, func) for name, func in self._checks.items()}
        return copy

    def run(self, root: Root, names: Sequence[str] | None = None) -> list[CheckResult]:
        """Every check's result (or those in ``names``); a check that cannot read what it needs
        FAILs alone."""
        results = []
        for name, func in self._checks.items():
            if names is not None and name not in names:
                continue
            try:
                result = func(root)
            except (OSError, UnicodeDecodeError, TpubootError) as exc:
                result = failed(f"cannot read: {exc}", "run as root, or fix the file's permissions")
            results.append(dataclasses.replace(result, name=name))
        return results


IMAGE_CHECKS = Checks()


def run_checks(
    root: Root, only: Sequence[str] = (), *, next_boot: bool = False, systemd: Systemd | None = None
) -> list[CheckResult]:
    """The image checks against ``root`` (``tpuboot image-check``); ``only``: name patterns.

    ``next_boot`` (``tpuboot prepare-image``): judge what the next boot gets even on a running
    system (the command line update-grub will write, the installed kernels), not what is in
    force now. ``systemd``: who answers ``systemctl show`` (default: systemctl itself, on the host)."""
    checks = NEXT_BOOT_CHECKS if next_boot else IMAGE_CHECKS
    if systemd is not None:
        checks = checks.with_overrides(limit_checks(systemd))
    return checks.run(root, checks.select(only) if only else None)


# --- Reading files under the root ---------------------------------------------------------------


MAX_FILE_BYTES = 1 << 20  # configuration files and /proc entries; anything bigger is not one


def _read(root: Root, path: str) -> str | None:
    """The text of ``path`` under ``root`` (absolute symlinks followed under it, as in an image
    tree), or None if it does not exist."""
    data = read_file(root, path, limit=MAX_FILE_BYTES)
    return None if data is None else data.decode("utf-8")


def _masked(path: Path) -> bool:
    """A symlink to /dev/null: hides the files of that name in lower-priority directories."""
    return path.is_symlink() and os.readlink(path) == "/dev/null"


def _layered(root: Root, dirs: tuple[str, ...], pattern: str) -> list[str]:
    """Files matching ``pattern`` in ``dirs`` (highest priority first), as systemd and udev merge
    them: the first directory holding a name wins, masked names drop out, sorted by name."""
    chosen: dict[str, Path] = {}
    for directory in dirs:
        real = root.path(directory)
        if not real.is_dir():
            continue
        for entry in real.iterdir():
            if entry.name not in chosen and fnmatch.fnmatchcase(entry.name, pattern):
                chosen[entry.name] = entry
    return [
        root.strip(path)
        for _, path in sorted(chosen.items())
        if not _masked(path) and not root.path(root.strip(path)).is_dir()  # a link resolved under the root
    ]


def _texts(root: Root, paths: list[str]) -> Iterator[tuple[str, str]]:
    """(path, text) of each of ``paths`` that exists."""
    for path in paths:
        text = _read(root, path)
        if text is not None:
            yield path, text


# --- Kernel command line and transparent huge pages -------------------------------------------

GRUB_DROPIN = "/etc/default/grub.d/tpuboot.cfg"


def _cmdline(root: Root) -> list[Param] | None:
    """``/proc/cmdline`` as the kernel parsed it, or None on a tree that is not running."""
    data = read_file(root, "/proc/cmdline", limit=MAX_FILE_BYTES)
    return None if data is None else kernel_params(data)


def kernel_arch(root: Root) -> str:
    """The running kernel's architecture (``/proc/sys/kernel/arch``; the host's if unreadable)."""
    text = _read(root, "/proc/sys/kernel/arch")
    return text.strip() if text else os.uname().machine


def image_arch(root: Root) -> str:
    """The image's architecture: dpkg's (``/var/lib/dpkg/arch``, else the kernel's)."""
    text = _read(root, "/var/lib/dpkg/arch")
    words = (text or "").split()
    return words[0] if words else kernel_arch(root)


@dataclass(frozen=True)
class Cmdline:
    """A kernel command line to judge and what it is (shown in the detail)."""

    params: list[Param]
    what: str


def running_or_next(root: Root) -> Cmdline | CheckResult:
    """The running kernel's command line on a running system; on a tree (no /proc/cmdline), the
    one its next boot gets (``image-check --root``)."""
    params = _cmdline(root)
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


def _cmdline_fix(param: str, root: Root) -> str:
    if root.path(GRUB_DROPIN).exists():
        return f"{GRUB_DROPIN} adds {param} unless /etc/default/grub sets it: fix that, update-grub, reboot"
    return f"add {param} to the kernel command line: install tpuboot (its GRUB drop-in), update-grub, reboot"


def _cmdline_check(
    root: Root,
    name: str,
    want: str,
    ok: Callable[[list[str | None]], bool],
    source: CmdlineSource = running_or_next,
) -> CheckResult:
    """``ok`` gets every value ``name`` has on the command line, in order."""
    line = source(root)
    if isinstance(line, CheckResult):
        return line
    values = [param.value for param in line.params if param.name == name]
    if ok(values):
        return passed(f"{line.what} has {want}")
    found = " ".join(f"{name}={v}" if v is not None else name for v in values) or f"no {name}="
    return failed(f"{line.what} lacks {want} ({found})", _cmdline_fix(want, root))


@IMAGE_CHECKS.add("cmdline-idle-poll")
def check_idle_poll(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    """idle=poll: CPUs never enter low-power idle states (latency)."""
    return _cmdline_check(root, "idle", "idle=poll", lambda values: values[-1:] == ["poll"], source)


@IMAGE_CHECKS.add("cmdline-transparent-hugepage")
def check_thp_cmdline(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    return _cmdline_check(
        root,
        "transparent_hugepage",
        "transparent_hugepage=always",
        lambda values: values[-1:] == ["always"],
        source,
    )


def _intel_iommu_ok(values: list[str | None]) -> bool:
    """Options accumulate over every intel_iommu= in order; the last on/off and sm_on/sm_off win."""
    on = scalable = False
    for value in values:
        for option in (value or "").split(","):
            if option in ("on", "off"):
                on = option == "on"
            elif option in ("sm_on", "sm_off"):
                scalable = option == "sm_on"
    return on and scalable


@IMAGE_CHECKS.add("cmdline-intel-iommu")
def check_intel_iommu(root: Root, source: CmdlineSource = running_or_next) -> CheckResult:
    """intel_iommu=on,sm_on: the IOMMU in scalable mode, which vfio-pci needs (x86_64 only)."""
    machine = kernel_arch(root) if source is running_or_next else image_arch(root)
    if machine not in X86:
        return skipped(f"not needed on {machine}")
    return _cmdline_check(root, "intel_iommu", IOMMU_PARAM, _intel_iommu_ok, source)


@IMAGE_CHECKS.add("vfio-pci-in-kernel")
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


@IMAGE_CHECKS.add("thp-enabled")
def check_thp_enabled(root: Root) -> CheckResult:
    """What the kernel does now, whatever the command line said."""
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    text = _read(root, path)
    if text is None:
        return skipped(f"no {path}: not a running system, or a kernel without THP")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text.strip()
    if mode == "always":
        return passed("transparent huge pages: always")
    return failed(
        f"transparent huge pages: {mode}",
        f"echo always > {path} now; transparent_hugepage=always on the kernel command line for every boot",
    )


# --- Limits --------------------------------------------------------------------------------------

MIN_NOFILE = 100_000
UNLIMITED = math.inf


@dataclass(frozen=True)
class Limit:
    """A resource limit and where it comes from; soft or hard None: not set, a default applies."""

    soft: float | None
    hard: float | None
    source: str

    def at_least(self, minimum: float) -> bool:
        return all(value is not None and value >= minimum for value in (self.soft, self.hard))

    def __str__(self) -> str:
        if self.soft is None and self.hard is None:
            return self.source

        def show(value: float | None) -> str:
            if value is None:
                return "default"
            return "unlimited" if value == UNLIMITED else str(int(value))

        text = show(self.soft) if self.soft == self.hard else f"{show(self.soft)}:{show(self.hard)}"
        return f"{text} ({self.source})"


NOT_SET = Limit(None, None, "not set")
ITEMS = {"memlock": UNLIMITED, "nofile": MIN_NOFILE}  # what the TPU runtime needs of each
WANT = {"memlock": "unlimited", "nofile": str(MIN_NOFILE)}


def _judge(what: str, limits: dict[str, Limit], fix: str) -> CheckResult:
    detail = f"{what}: " + ", ".join(f"{item} {limit}" for item, limit in limits.items())
    if all(limit.at_least(ITEMS[item]) for item, limit in limits.items()):
        return passed(detail)
    return failed(f"{detail}; need memlock unlimited and nofile >= {MIN_NOFILE}", fix)


# PAM (pam_limits): logins only.

PAM_LIMITS = "/etc/security/limits.conf"
PAM_LIMITS_DIR = "/etc/security/limits.d"
PAM_DROPIN = "/etc/security/limits.d/tpuboot.conf"


def _pam_value(text: str) -> float:
    if text in ("unlimited", "infinity", "-1"):
        return UNLIMITED
    return float(int(text))


def pam_limit(root: Root, user: str, item: str) -> Limit:
    """The limit pam_limits gives ``user`` (``*``: any user but root) for ``item``.

    As pam_limits: limits.conf, then limits.d/*.conf by name; an entry naming the user beats a
    ``*`` entry, a later entry beats an earlier one of the same kind; ``*`` never applies to
    root. Group entries are ignored (membership is per user)."""
    files = [PAM_LIMITS, *_layered(root, (PAM_LIMITS_DIR,), "*.conf")]
    best: dict[str, tuple[int, float, str]] = {}  # soft/hard -> (rank: 0 by name, 1 for *; value; file)
    for shown, text in _texts(root, files):
        for line in text.splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) != 4 or fields[2] != item:
                continue
            domain, kind, _, value = fields
            if domain == user and user != "*":
                rank = 0
            elif domain == "*" and user != "root":
                rank = 1
            else:
                continue
            try:
                number = _pam_value(value)
            except ValueError:
                continue  # pam_limits skips a malformed value too
            for which in ("soft", "hard"):
                if kind in (which, "-") and rank <= best.get(which, (2,))[0]:
                    best[which] = (rank, number, shown)
    if not best:
        return NOT_SET
    soft, hard = (best[which][1] if which in best else None for which in ("soft", "hard"))
    return Limit(soft, hard, ", ".join(sorted({entry[2] for entry in best.values()})))


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


@IMAGE_CHECKS.add("pam-memlock")
def check_pam_memlock(root: Root) -> CheckResult:
    """Locked-memory limit for logins: libtpu's "Couldn't mmap" otherwise."""
    return _pam_check(root, "memlock")


@IMAGE_CHECKS.add("pam-nofile")
def check_pam_nofile(root: Root) -> CheckResult:
    return _pam_check(root, "nofile")


# systemd: services, and the containers the container runtimes start.

UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
MANAGER_CONF = "/etc/systemd/system.conf"
MANAGER_DROPIN_DIRS = tuple(f"{d}.conf.d" for d in UNIT_DIRS)
MANAGER_DROPIN = "/usr/lib/systemd/system.conf.d/50-tpuboot.conf"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}


def parse_rlimit(text: str, source: str) -> Limit:
    """A systemd ``Limit*=`` value: ``infinity``, ``N`` (K, M, G... suffixes) or ``SOFT:HARD``."""

    def one(part: str) -> float:
        part = part.strip()
        if part == "infinity":
            return UNLIMITED
        match = re.fullmatch(r"(\d+)\s*([KMGTPE]?)i?B?", part)
        if not match:
            raise ValueError(f"{text!r} is not a resource limit")
        return float(int(match.group(1)) * _SUFFIX[match.group(2)])

    soft, _, hard = text.partition(":")
    return Limit(one(soft), one(hard or soft), source)


def _ini(text: str) -> Iterator[tuple[str, str, str]]:
    """(section, key, value) from a systemd unit or configuration file, continuations joined."""
    section, pending = "", ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif "=" in line:
            key, _, value = line.partition("=")
            yield section, key.strip(), value.strip()


def _file_limits(root: Root, files: list[str], section: str, prefix: str) -> dict[str, Limit | None]:
    """``{prefix}MEMLOCK`` and ``{prefix}NOFILE`` from ``files`` read in order (the last setting
    wins, an empty one resets); None for an item none of them sets."""
    keys = {f"{prefix}{item.upper()}": item for item in ITEMS}
    found: dict[str, tuple[str, str]] = {}
    for shown, text in _texts(root, files):
        for sect, key, value in _ini(text):
            if sect == section and key in keys:
                found[keys[key]] = (value, shown)
    out: dict[str, Limit | None] = {}
    for item in ITEMS:
        value, shown = found.get(item, ("", ""))
        try:
            out[item] = parse_rlimit(value, shown) if value else None
        except ValueError:
            out[item] = Limit(None, None, f"{value!r} in {shown} is unreadable")
    return out


class Systemd:
    """What systemd has in force, from ``systemctl show``; the limit checks ask it before the files.
    A test passes its own (``run_checks(systemd=...)``, ``Doctor(systemd=...)``)."""

    def live(self, root: Root) -> bool:
        """True when ``systemctl show`` can tell what is in force: the host, with systemd running."""
        return root.is_host and root.path("/run/systemd/system").is_dir()

    def show(self, unit: str | None, properties: list[str]) -> dict[str, str] | None:
        """``systemctl show`` of the manager (``unit`` None) or of a unit; None if it cannot answer."""
        argv = ["systemctl", "show", *(f"--property={p}" for p in properties), *([unit] if unit else [])]
        try:
            out = subproc.run(argv, timeout=10)
        except TpubootError:
            return None
        return dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)


SYSTEMD = Systemd()


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
    files = [MANAGER_CONF, *_layered(root, MANAGER_DROPIN_DIRS, "*.conf")]
    limits = _file_limits(root, files, "Manager", "DefaultLimit")
    return {item: limit or Limit(None, None, "systemd's built-in default") for item, limit in limits.items()}


def check_manager_limits(root: Root, systemd: Systemd = SYSTEMD) -> CheckResult:
    """Every service's limits unless its unit sets its own: PAM limits never reach services."""
    fix = (
        f"install tpuboot ({MANAGER_DROPIN}) or set DefaultLimitMEMLOCK=infinity and "
        f"DefaultLimitNOFILE={MIN_NOFILE} in /etc/systemd/system.conf.d/, then reboot"
    )
    return _judge("systemd defaults", manager_limits(root, systemd), fix)


def _unit_file(root: Root, unit: str) -> str | None:
    """The unit's file (maybe an alias symlink, read under the root), None if absent or masked."""
    path = next(
        (f"{d}/{unit}" for d in UNIT_DIRS if os.path.lexists(root.path(f"{d}/{unit}", follow=False))), None
    )
    if path is None or _masked(root.path(path, follow=False)) or _read(root, path) is None:
        return None
    return path


def unit_limits(root: Root, unit: str, systemd: Systemd = SYSTEMD) -> dict[str, Limit] | None:
    """A service's memlock and nofile limits; None if the unit is not installed (or masked)."""
    if systemd.live(root) and (live := _shown_limits(systemd, unit, "Limit", ("LoadState",))) is not None:
        limits, shown = live
        return limits if shown.get("LoadState") == "loaded" else None
    path = _unit_file(root, unit)
    if path is None:
        return None
    kind = unit.rsplit(".", 1)[-1]
    dropins = _layered(root, tuple(f"{d}/{unit}.d" for d in UNIT_DIRS), "*.conf")
    dropins += _layered(root, tuple(f"{d}/{kind}.d" for d in UNIT_DIRS), "*.conf")  # for every service
    dropins.sort(key=os.path.basename)
    own = _file_limits(root, [path, *dropins], "Service", "Limit")
    default = manager_limits(root, systemd)
    return {
        item: limit or dataclasses.replace(default[item], source=f"default: {default[item].source}")
        for item, limit in own.items()
    }


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


def limit_checks(systemd: Systemd) -> dict[str, Check]:
    """The checks that ask ``systemd`` what is in force, by name."""
    return {
        "systemd-default-limits": lambda root: check_manager_limits(root, systemd),
        "docker-limits": _runtime_check("docker.service", systemd),
        "containerd-limits": _runtime_check("containerd.service", systemd),
    }


for _name, _check in limit_checks(SYSTEMD).items():
    IMAGE_CHECKS.add(_name)(_check)


# --- udev --------------------------------------------------------------------------------------

UDEV_RULES_DIRS = (
    "/etc/udev/rules.d",
    "/run/udev/rules.d",
    "/usr/local/lib/udev/rules.d",
    "/usr/lib/udev/rules.d",
    "/lib/udev/rules.d",
)
_UDEV_TOKEN = re.compile(r'([A-Z_]+(?:\{[^}]*\})?)\s*(==|!=|\+=|-=|:=|=)\s*"([^"]*)"')


def _udev_rules(text: str) -> Iterator[list[tuple[str, str, str]]]:
    """Each rule in a rules file as its (key, operator, value) tokens."""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        if line and not line.startswith("#"):
            yield _UDEV_TOKEN.findall(line)


def _grants_accel(rule: list[tuple[str, str, str]]) -> bool:
    kernel = [v for k, op, v in rule if k == "KERNEL" and op == "=="]
    removing = any(k == "ACTION" and op == "==" and v == "remove" for k, op, v in rule)
    mode = [v for k, op, v in rule if k == "MODE" and op in ("=", ":=")]
    return (
        not removing
        and any(fnmatch.fnmatchcase("accel0", pattern) for p in kernel for pattern in p.split("|"))
        and mode[-1:] == ["0666"]
    )


@IMAGE_CHECKS.add("accel-udev-rule")
def check_accel_rule(root: Root) -> CheckResult:
    """/dev/accel* (TPU v2 to v4, the kernel's accel driver) open to every user."""
    for shown, text in _texts(root, _layered(root, UDEV_RULES_DIRS, "*.rules")):
        if any(_grants_accel(rule) for rule in _udev_rules(text)):
            return passed(f"{shown} gives accel* mode 0666")
    return failed(
        "no udev rule gives accel* mode 0666",
        'install tpuboot (70-tpuboot.rules) or put KERNEL=="accel*", MODE="0666" in /etc/udev/rules.d/',
    )


# --- The documented procedure's leftovers ------------------------------------------------------
#
# An image built by the documented custom-image procedure and then given tpuboot keeps the
# procedure's files, and each fights tpuboot: a second vfio binder racing tpuboot's, a second
# writer of tpu-env, /etc/environment appended at every boot, GRUB and limits edits that purge
# cannot take back. They are found by what they do (a udev rule whose RUN binds to vfio-pci, a
# boot-time script that fetches tpu-env), not by their documented names. A leftover that fights
# tpuboot is a FAIL; one that only duplicates what tpuboot sets is a WARN. tpuboot's own files
# (names holding "tpuboot") are never flagged. debian/tpuboot.postinst runs these checks
# (``image-check --only 'leftover-*'``) to warn at install.

TPUBOOT_UDEV_RULE = "70-tpuboot.rules"
#: Where the procedure's boot-time scripts live (its write_files targets) and where such scripts
#: are commonly kept: a script here runs only if something names it.
SCRIPT_DIRS = ("/var/scripts", "/usr/local/bin", "/usr/local/sbin", "/lib/udev", "/usr/lib/udev")
#: What runs at boot and may run a leftover: cloud-init's configuration, per-boot/instance/once
#: scripts, the current instance's user-data and generated scripts, NoCloud seeds baked into the
#: image, rc.local, cron and the admin's units.
RUNNER_FILES = (
    "/etc/cloud/cloud.cfg",
    "/etc/rc.local",
    "/etc/crontab",
    "/var/lib/cloud/seed/nocloud/user-data",
    "/var/lib/cloud/seed/nocloud-net/user-data",
)
RUNNER_DIRS = (
    "/etc/cloud/cloud.cfg.d",
    "/var/lib/cloud/scripts/per-boot",
    "/var/lib/cloud/scripts/per-instance",
    "/var/lib/cloud/scripts/per-once",
    "/etc/cron.d",
    "/etc/systemd/system",
)
CLOUD_INSTANCE_LINK = "/var/lib/cloud/instance"  # -> instances/<id>: this instance's files
CLOUD_INSTANCE_FILES = ("user-data.txt", "cloud-config.txt", "vendor-data.txt")
_NOT_FILES = ("/proc/", "/sys/", "/dev/", "/run/")
_NAMED_PATH = re.compile(r"(?<![\w$}])/[\w.+@-]+(?:/[\w.+@-]+)+")
MAX_NAMED_PATHS = 64  # paths named in one runner that are followed to their scripts
MAX_SCRIPT_BYTES = 256 << 10  # bigger files (dockerd, udev's hwdb.bin) are no boot script: not read


def _own(path: str) -> bool:
    return "tpuboot" in os.path.basename(path)


def _read_quiet(root: Root, path: str) -> str | None:
    """``path``'s text, or None when it is absent, not a regular file, big, unreadable or not
    text: a leftover scan reads files it knows nothing about and judges only those it can read."""
    try:
        if root.path(path).stat().st_size > MAX_SCRIPT_BYTES:
            return None
        return _read(root, path)
    except (TpubootError, OSError, UnicodeDecodeError):
        return None


def _files_in(root: Root, directory: str) -> list[str]:
    """The regular files directly in ``directory`` under the root, sorted (none if absent)."""
    real = root.path(directory)
    if not real.is_dir():
        return []
    return sorted(f"{directory}/{e.name}" for e in real.iterdir() if not e.is_symlink() and e.is_file())


def _cloud_instance(root: Root) -> str | None:
    """The current cloud-init instance directory (the link's target, read under the root)."""
    link = root.path(CLOUD_INSTANCE_LINK, follow=False)
    if not link.is_symlink():
        return CLOUD_INSTANCE_LINK if link.is_dir() else None
    target = os.readlink(link)
    if not target.startswith("/"):
        target = os.path.normpath(f"{os.path.dirname(CLOUD_INSTANCE_LINK)}/{target}")
    return target if root.path(target).is_dir() and not root.path(target, follow=False).is_symlink() else None


def _runners(root: Root) -> Iterator[tuple[str, str]]:
    """(path, text) of every file that runs something at boot, tpuboot's own left out."""
    paths = list(RUNNER_FILES)
    for directory in RUNNER_DIRS:
        paths += _files_in(root, directory)
    instance = _cloud_instance(root)
    if instance is not None:
        paths += [f"{instance}/{name}" for name in CLOUD_INSTANCE_FILES]
        paths += _files_in(root, f"{instance}/scripts")
    seen: set[str] = set()
    for path in paths:
        if path in seen or _own(path):
            continue
        seen.add(path)
        text = _read_quiet(root, path)
        if text is not None:
            yield path, text


def _scripts(root: Root) -> Iterator[tuple[str, str]]:
    """(path, text) of the files in SCRIPT_DIRS, each real file once (/lib may be /usr/lib)."""
    seen: set[str] = set()
    for directory in SCRIPT_DIRS:
        for path in _files_in(root, directory):
            real = root.resolve(path)
            if real in seen or _own(path):
                continue
            seen.add(real)
            text = _read_quiet(root, path)
            if text is not None:
                yield path, text


@dataclass(frozen=True)
class Leftover:
    """A runner that does the thing (``via``: the script it runs that does it, or None)."""

    runner: str
    via: str | None = None

    def __str__(self) -> str:
        return self.runner if self.via is None else f"{self.runner} (running {self.via})"


def _boot_leftovers(root: Root, does: Callable[[str], bool]) -> tuple[list[Leftover], list[str]]:
    """Runners that do what ``does`` recognises, themselves or through a script whose path they
    name; and the scripts that do it but that nothing in the image runs."""
    found: list[Leftover] = []
    run: set[str] = set()
    for runner, text in _runners(root):
        if does(text):
            found.append(Leftover(runner))
            continue
        named = [p for p in dict.fromkeys(_NAMED_PATH.findall(text)) if not p.startswith(_NOT_FILES)]
        for path in named[:MAX_NAMED_PATHS]:
            script = None if _own(path) else _read_quiet(root, path)
            if script is not None and does(script):
                found.append(Leftover(runner, path))
                run.add(path)
                break
    idle = [path for path, text in _scripts(root) if path not in run and does(text)]
    return found, idle


def _removals(found: list[Leftover]) -> str:
    paths = dict.fromkeys(p for f in found for p in (f.runner, f.via) if p is not None)
    return " and ".join(paths)


def _judge_boot(root: Root, does: Callable[[str], bool], what: str, why: str) -> CheckResult:
    """FAIL for what runs at boot, WARN for a script nothing in the image runs (instance
    user-data given at VM creation may), PASS when there is neither."""
    found, idle = _boot_leftovers(root, does)
    if found:
        named = "; ".join(map(str, found))
        return failed(f"{named}: runs at boot and {what}", f"remove {_removals(found)}: {why}")
    if idle:
        return warned(
            f"{', '.join(idle)}: {what}; nothing in the image runs it (instance user-data may)",
            f"remove {' and '.join(idle)} and any runcmd that runs it: {why}",
        )
    return passed(f"nothing at boot {what}")


# A second vfio binder.


def _binds_vfio(text: str) -> bool:
    """A script that binds devices to vfio-pci: it writes vfio-pci as a driver_override."""
    return "driver_override" in text and "vfio-pci" in text


def _run_programs(rule: list[tuple[str, str, str]]) -> list[str]:
    """The program of each RUN assignment (``RUN{program}`` too; not ``RUN{builtin}``)."""
    programs = []
    for key, op, value in rule:
        if key in ("RUN", "RUN{program}") and op in ("=", "+=", ":=") and value.split():
            programs.append(value.split()[0])
    return programs


def _rule_binds(root: Root, rule: list[tuple[str, str, str]]) -> str | None:
    """What makes ``rule`` a vfio binder (the script it runs, or its driver_override), or None."""
    for key, op, value in rule:
        if key == "ATTR{driver_override}" and op in ("=", ":=") and value == "vfio-pci":
            return 'ATTR{driver_override}="vfio-pci"'
    for program in _run_programs(rule):
        if _own(program):
            continue
        # udev runs a relative program from its own directories.
        paths = (
            [program]
            if program.startswith("/")
            else [f"{d}/{program}" for d in ("/lib/udev", "/usr/lib/udev")]
        )
        for path in paths:
            if _binds_vfio(_read_quiet(root, path) or ""):
                return path
        if "bind_to_vfio_pci" in os.path.basename(program):  # its script may be gone: still a binder
            return paths[0]
    return None


@IMAGE_CHECKS.add("leftover-vfio-binder")
def check_leftover_vfio_binder(root: Root) -> CheckResult:
    """A udev rule that binds TPUs to vfio-pci races tpuboot's bind (both write driver_override,
    unbind and probe the same device): FAIL. A bind script no rule runs: WARN."""
    rules: dict[str, list[str]] = {}  # rule file -> what binds in it
    for shown, text in _texts(root, _layered(root, UDEV_RULES_DIRS, "*.rules")):
        binders = [b for b in (_rule_binds(root, rule) for rule in _udev_rules(text)) if b]
        if binders and not _own(shown):
            rules[shown] = list(dict.fromkeys(binders))
    if rules:
        scripts = sorted(
            {b for binders in rules.values() for b in binders if b.startswith("/") and root.path(b).is_file()}
        )
        also = f" (and {' and '.join(scripts)})" if scripts else ""
        named = "; ".join(f"{path} ({', '.join(binders)})" for path, binders in rules.items())
        return failed(
            f"udev binds TPUs to vfio-pci beside tpuboot: {named}",
            f"remove {' and '.join(rules)}{also}: tpuboot binds TPUs itself",
        )
    idle = [path for path, text in _scripts(root) if _binds_vfio(text)]
    if idle:
        return warned(
            f"{', '.join(idle)} binds devices to vfio-pci; no udev rule runs it",
            f"remove {' and '.join(idle)}: tpuboot binds TPUs itself (`tpuboot bind DBDF` by hand)",
        )
    return passed("no udev rule binds to vfio-pci but tpuboot")


@IMAGE_CHECKS.add("leftover-accel-rule")
def check_leftover_accel_rule(root: Root) -> CheckResult:
    """A second rule setting /dev/accel*'s mode: harmless while both say 0666, but the later file
    wins over tpuboot's rule and over an admin's override of it (WARN)."""
    files = _layered(root, UDEV_RULES_DIRS, "*.rules")
    if not any(os.path.basename(f) == TPUBOOT_UDEV_RULE for f in files):
        return skipped(f"tpuboot's {TPUBOOT_UDEV_RULE} is not installed: another accel rule is no leftover")
    others = [
        shown
        for shown, text in _texts(root, files)
        if not _own(shown)
        and any(
            any(
                fnmatch.fnmatchcase("accel0", p)
                for k, op, v in rule
                if k == "KERNEL" and op == "=="
                for p in v.split("|")
            )
            and any(k == "MODE" and op in ("=", ":=") for k, op, v in rule)
            for rule in _udev_rules(text)
        )
    ]
    if others:
        return warned(
            f"{', '.join(others)} also sets the accel* mode (the later file wins over {TPUBOOT_UDEV_RULE})",
            f"remove {' and '.join(others)}: tpuboot's {TPUBOOT_UDEV_RULE} sets it "
            f"(to change it, put a {TPUBOOT_UDEV_RULE} in /etc/udev/rules.d/)",
        )
    return passed(f"only {TPUBOOT_UDEV_RULE} sets the accel* mode")


# Boot-time scripts of cloud-init.

_FETCHES_TPU_ENV = re.compile(r"attributes/tpu-env\b")
_WRITES_TPU_ENV = re.compile(r"""(?:>>?|\btee(?:\s+-a)?)\s*["']?[^\s"';|&]*/tpu-env["']?(?:[\s;|&)]|\Z)""")


def _writes_tpu_env(text: str) -> bool:
    """Fetches the tpu-env attribute (the only reason to at boot is to write it), or redirects
    output into a file named tpu-env."""
    return bool(_FETCHES_TPU_ENV.search(text) or _WRITES_TPU_ENV.search(text))


@IMAGE_CHECKS.add("leftover-tpu-env-writer")
def check_leftover_tpu_env_writer(root: Root) -> CheckResult:
    """Two writers of tpu-env: the last one wins, and the documented one evals the values (a shell
    injection) and writes no cache, so a slow metadata server at boot leaves an empty file."""
    return _judge_boot(
        root,
        _writes_tpu_env,
        "writes tpu-env",
        "tpuboot writes tpu-env (and keeps it current)",
    )


def _appends_environment(text: str) -> bool:
    """A line appending one of tpuboot's /etc/environment keys (CLOUDSDK_PYTHON, the GCS
    timeouts), as the documented scripts do at every boot."""
    appends = re.compile(r"""(?:>>\s*|\btee\s+(?:-\w+\s+)*-a\s+(?:-\w+\s+)*)["']?/etc/environment\b""")
    keys = re.compile(r"\b(?:" + "|".join(map(re.escape, DEFAULT_ENVIRONMENT)) + r")=")
    return any(appends.search(line) and keys.search(line) for line in text.splitlines())


@IMAGE_CHECKS.add("leftover-environment-appender")
def check_leftover_environment_appender(root: Root) -> CheckResult:
    """A boot-time script appending tpuboot's keys to /etc/environment: the file grows at each
    boot and the appended value counts as the admin's, so tpuboot's env.environment is ignored."""
    return _judge_boot(
        root,
        _appends_environment,
        "appends tpuboot's keys to /etc/environment",
        "tpuboot sets each env.environment key once",
    )


_QUERIES_METADATA = re.compile(r"computeMetadata/v1/instance/")


def _metadata_utility(text: str) -> bool:
    """A helper that prints the metadata value named on its command line (get-vm-metadata.py)."""
    return bool(_QUERIES_METADATA.search(text)) and "sys.argv" in text and not _writes_tpu_env(text)


@IMAGE_CHECKS.add("leftover-metadata-script")
def check_leftover_metadata_script(root: Root) -> CheckResult:
    """get-vm-metadata.py: harmless, but it asks metadata.google.internal (which may not resolve
    early in boot) without retries, checking no Metadata-Flavor answer (WARN)."""
    found = [path for path, text in _scripts(root) if _metadata_utility(text)]
    if found:
        return warned(
            f"{', '.join(found)} reads metadata values",
            f"remove {' and '.join(found)}: `tpuboot metadata get KEY [--default V] [--type T]` does it, "
            "with retries",
        )
    return passed("no metadata helper script besides tpuboot's")


# Edits of files tpuboot's drop-ins now cover.


def _limits_lines(text: str) -> list[str]:
    """limits.conf lines setting memlock or nofile for every user (``*``) or root."""
    lines = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 4 and fields[0] in ("*", "root") and fields[2] in ITEMS:
            lines.append(" ".join(fields))
    return lines


@IMAGE_CHECKS.add("leftover-limits-conf")
def check_leftover_limits(root: Root) -> CheckResult:
    """memlock/nofile lines in limits.conf beside tpuboot's drop-in: it wins (read later), and
    ``apt purge tpuboot`` cannot take the edits back (WARN)."""
    if _read(root, PAM_DROPIN) is None:
        return skipped(f"no {PAM_DROPIN}: the limits.conf lines are no leftover")
    lines = _limits_lines(_read(root, PAM_LIMITS) or "")
    if lines:
        return warned(
            f"{PAM_LIMITS} sets memlock/nofile ({'; '.join(lines)}) beside {PAM_DROPIN}",
            f"remove the memlock and nofile lines from {PAM_LIMITS}: {PAM_DROPIN} sets them",
        )
    return passed(f"only {PAM_DROPIN} sets memlock and nofile")


GRUB_DEFAULT = "/etc/default/grub"
TPU_PARAMS = {"idle": "poll", "transparent_hugepage": "always", "intel_iommu": "on,sm_on"}
_GRUB_CMDLINE = re.compile(r"""^\s*(GRUB_CMDLINE_LINUX(?:_DEFAULT)?)=(?:"([^"]*)"|'([^']*)'|(\S*))""", re.M)


def _param_ok(name: str, values: list[str]) -> bool:
    if name == "intel_iommu":
        return _intel_iommu_ok(list(values))
    return values[-1:] == [TPU_PARAMS[name]]


@IMAGE_CHECKS.add("leftover-grub-cmdline")
def check_leftover_grub(root: Root) -> CheckResult:
    """TPU parameters typed into /etc/default/grub. tpuboot's drop-in adds a parameter only if it
    is not set, so a wrong value there wins (the documented THP sed, run after the IOMMU one,
    gives ``intel_iommu=on transparent_hugepage=always,sm_on``): FAIL. Right values only
    duplicate the drop-in's, but stay after ``apt purge tpuboot``: WARN."""
    text = _read(root, GRUB_DEFAULT)
    if text is None:
        return passed(f"no {GRUB_DEFAULT}: no parameter typed there")
    line: dict[str, str] = {}
    for match in _GRUB_CMDLINE.finditer(text):  # the last assignment of each variable wins
        line[match.group(1)] = next(g for g in match.groups()[1:] if g is not None)
    typed = " ".join(line.get(v, "") for v in ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT"))
    set_here: dict[str, list[str]] = {}
    for param in kernel_params(typed.encode("utf-8")):
        if param.name in TPU_PARAMS:
            set_here.setdefault(param.name, []).append(param.value or "")
    if not set_here:
        return passed(f"{GRUB_DEFAULT} sets no TPU kernel parameter")
    wrong = {name: values for name, values in set_here.items() if not _param_ok(name, values)}
    shown = " ".join(f"{name}={v}" for name, values in set_here.items() for v in values)
    if wrong:
        want = " ".join(f"{name}={TPU_PARAMS[name]}" for name in wrong)
        return failed(
            f"{GRUB_DEFAULT} sets {shown}; tpuboot's drop-in then adds nothing for {', '.join(wrong)}",
            f"remove {' '.join(f'{n}={v}' for n, vs in wrong.items() for v in vs)} from {GRUB_DEFAULT} "
            f"(tpuboot's {GRUB_DROPIN} adds {want}), update-grub, reboot",
        )
    if not root.path(GRUB_DROPIN).exists():
        return passed(f"{GRUB_DEFAULT} sets {shown} (no {GRUB_DROPIN}: they are needed there)")
    return warned(
        f"{GRUB_DEFAULT} sets {shown}, as {GRUB_DROPIN} does",
        f"remove {shown} from {GRUB_DEFAULT}, update-grub: {GRUB_DROPIN} adds them (and purge removes it)",
    )


_ENV_KEY = re.compile(r"^[ \t]*(?:export[ \t]+)?([A-Za-z_][A-Za-z0-9_]*)=")
ENVIRONMENT = "/etc/environment"


@IMAGE_CHECKS.add("leftover-environment-duplicates")
def check_leftover_environment_duplicates(root: Root) -> CheckResult:
    """Keys assigned more than once in /etc/environment (the documented scripts appended at
    every boot): pam_env reads the last, so the lines are only noise while they agree (WARN)."""
    text = _read(root, ENVIRONMENT)
    if text is None:
        return passed(f"no {ENVIRONMENT}: no line repeated")
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = _ENV_KEY.match(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    repeated = {key: n for key, n in counts.items() if n > 1}
    if not repeated:
        return passed(f"{ENVIRONMENT} assigns each variable once")
    listed = ", ".join(f"{key} {n} times" for key, n in sorted(repeated.items()))
    return warned(
        f"{ENVIRONMENT} assigns {listed}",
        f"keep one line per variable in {ENVIRONMENT} (`tpuboot env` collapses its keys' identical repeats)",
    )


def _thp_next_boot(root: Root) -> CheckResult:
    return skipped("set at boot by transparent_hugepage= (see cmdline-transparent-hugepage)")


#: The same checks judging the next boot (``prepare-image`` on a build VM, whose own boot is not
#: the image's): the command line from the GRUB defaults, every installed kernel, THP by its
#: command-line parameter only.
NEXT_BOOT_CHECKS = IMAGE_CHECKS.with_overrides(
    {
        "cmdline-idle-poll": lambda root: check_idle_poll(root, next_boot_cmdline),
        "cmdline-transparent-hugepage": lambda root: check_thp_cmdline(root, next_boot_cmdline),
        "cmdline-intel-iommu": lambda root: check_intel_iommu(root, next_boot_cmdline),
        "vfio-pci-in-kernel": lambda root: check_vfio_pci_in_kernel(root, installed=True),
        "thp-enabled": _thp_next_boot,
    }
)
