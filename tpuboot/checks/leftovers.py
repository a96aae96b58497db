"""The image checks for the documented procedure's leftovers (``leftover-*``).

An image built by the documented custom-image procedure and then given tpuboot keeps the
procedure's files, and each fights tpuboot: a second vfio binder racing tpuboot's, a second
writer of tpu-env, /etc/environment appended at every boot, GRUB and limits edits that purge
cannot take back. They are found by what they do (a udev rule whose RUN binds to vfio-pci, a
boot-time script that fetches tpu-env), not by their documented names. A leftover that fights
tpuboot is a FAIL; one that only duplicates what tpuboot sets is a WARN. tpuboot's own files
(names holding "tpuboot") are never flagged. debian/tpuboot.postinst runs these checks
(``image-check --only 'leftover-*'``) to warn at install.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from tpuboot.checks.kernel import param_ok
from tpuboot.checks.limits import ITEMS, PAM_DROPIN
from tpuboot.checks.parsers.boot_runners import named_paths, own, read_quiet, runners, scripts
from tpuboot.checks.parsers.files import layered, read_text, texts
from tpuboot.checks.parsers.grub import CMDLINE_VARS, GRUB_DEFAULT, TPUBOOT_DROPIN, NextBoot, Unreadable
from tpuboot.checks.parsers.pam import PAM_LIMITS, entries
from tpuboot.checks.parsers.udev import UDEV_RULES_DIRS, Rule, program_paths, run_programs, udev_rules
from tpuboot.checks.udev import TPUBOOT_UDEV_RULE, names_accel
from tpuboot.config import DEFAULT_ENVIRONMENT
from tpuboot.env.assignment import PAM_ASSIGNMENT
from tpuboot.gce.keys import API_ROOT, INSTANCE
from tpuboot.kernel_params import TPU_PARAMS, word
from tpuboot.paths import Root
from tpuboot.verdicts import Check, CheckResult, Criterion, failed, passed, skipped, warned


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
    for runner, text in runners(root):
        if does(text):
            found.append(Leftover(runner))
            continue
        for path in named_paths(text):
            script = None if own(path) else read_quiet(root, path)
            if script is not None and does(script):
                found.append(Leftover(runner, path))
                run.add(path)
                break
    idle = [path for path, text in scripts(root) if path not in run and does(text)]
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


def _rule_binds(root: Root, rule: Rule) -> str | None:
    """What makes ``rule`` a vfio binder (the script it runs, or its driver_override), or None."""
    for key, op, value in rule:
        if key == "ATTR{driver_override}" and op in ("=", ":=") and value == "vfio-pci":
            return 'ATTR{driver_override}="vfio-pci"'
    for program in run_programs(rule):
        if own(program):
            continue
        paths = program_paths(program)
        for path in paths:
            if _binds_vfio(read_quiet(root, path) or ""):
                return path
        if "bind_to_vfio_pci" in os.path.basename(program):  # its script may be gone: still a binder
            return paths[0]
    return None


VFIO_BINDER = Criterion(
    "leftover-vfio-binder", "no udev rule or script binding TPUs to vfio-pci beside tpuboot"
)


def check_leftover_vfio_binder(root: Root) -> CheckResult:
    """A udev rule that binds TPUs to vfio-pci races tpuboot's bind (both write driver_override,
    unbind and probe the same device): FAIL. A bind script no rule runs: WARN."""
    rules: dict[str, list[str]] = {}  # rule file -> what binds in it
    for shown, text in texts(root, layered(root, UDEV_RULES_DIRS, "*.rules")):
        binders = [b for b in (_rule_binds(root, rule) for rule in udev_rules(text)) if b]
        if binders and not own(shown):
            rules[shown] = list(dict.fromkeys(binders))
    if rules:
        scripts_run = sorted(
            {b for binders in rules.values() for b in binders if b.startswith("/") and root.path(b).is_file()}
        )
        also = f" (and {' and '.join(scripts_run)})" if scripts_run else ""
        named = "; ".join(f"{path} ({', '.join(binders)})" for path, binders in rules.items())
        return failed(
            f"udev binds TPUs to vfio-pci beside tpuboot: {named}",
            f"remove {' and '.join(rules)}{also}: tpuboot binds TPUs itself",
        )
    idle = [path for path, text in scripts(root) if _binds_vfio(text)]
    if idle:
        return warned(
            f"{', '.join(idle)} binds devices to vfio-pci; no udev rule runs it",
            f"remove {' and '.join(idle)}: tpuboot binds TPUs itself (`tpuboot bind DBDF` by hand)",
        )
    return passed("no udev rule binds to vfio-pci but tpuboot")


ACCEL_RULE = Criterion("leftover-accel-rule", "no second rule setting /dev/accel*'s mode beside tpuboot's")


def check_leftover_accel_rule(root: Root) -> CheckResult:
    """A second rule setting /dev/accel*'s mode: harmless while both say 0666, but the later file
    wins over tpuboot's rule and over an admin's override of it (WARN)."""
    files = layered(root, UDEV_RULES_DIRS, "*.rules")
    if not any(os.path.basename(f) == TPUBOOT_UDEV_RULE for f in files):
        return skipped(f"tpuboot's {TPUBOOT_UDEV_RULE} is not installed: another accel rule is no leftover")
    others = [
        shown
        for shown, text in texts(root, files)
        if not own(shown)
        and any(
            names_accel(rule) and any(k == "MODE" and op in ("=", ":=") for k, op, v in rule)
            for rule in udev_rules(text)
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


TPU_ENV_WRITER = Criterion("leftover-tpu-env-writer", "no second writer of tpu-env at boot")


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


ENVIRONMENT_APPENDER = Criterion(
    "leftover-environment-appender", "no boot-time script appending tpuboot's keys to /etc/environment"
)


def check_leftover_environment_appender(root: Root) -> CheckResult:
    """A boot-time script appending tpuboot's keys to /etc/environment: the file grows at each
    boot and the appended value counts as the admin's, so tpuboot's env.environment is ignored."""
    return _judge_boot(
        root,
        _appends_environment,
        "appends tpuboot's keys to /etc/environment",
        "tpuboot sets each env.environment key once",
    )


_QUERIES_METADATA = re.compile(re.escape(API_ROOT + INSTANCE))


def _metadata_utility(text: str) -> bool:
    """A helper that prints the metadata value named on its command line (get-vm-metadata.py)."""
    return bool(_QUERIES_METADATA.search(text)) and "sys.argv" in text and not _writes_tpu_env(text)


METADATA_SCRIPT = Criterion(
    "leftover-metadata-script", "no get-vm-metadata.py asking the metadata server without retries"
)


def check_leftover_metadata_script(root: Root) -> CheckResult:
    """get-vm-metadata.py: harmless, but it asks metadata.google.internal (which may not resolve
    early in boot) without retries, checking no Metadata-Flavor answer (WARN)."""
    found = [path for path, text in scripts(root) if _metadata_utility(text)]
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
    return [" ".join(fields) for fields in entries(text) if fields[0] in ("*", "root") and fields[2] in ITEMS]


LIMITS_CONF = Criterion(
    "leftover-limits-conf", "no memlock or nofile line in limits.conf beside tpuboot's drop-in"
)


def check_leftover_limits(root: Root) -> CheckResult:
    """memlock/nofile lines in limits.conf beside tpuboot's drop-in: it wins (read later), and
    ``apt purge tpuboot`` cannot take the edits back (WARN)."""
    if read_text(root, PAM_DROPIN) is None:
        return skipped(f"no {PAM_DROPIN}: the limits.conf lines are no leftover")
    lines = _limits_lines(read_text(root, PAM_LIMITS) or "")
    if lines:
        return warned(
            f"{PAM_LIMITS} sets memlock/nofile ({'; '.join(lines)}) beside {PAM_DROPIN}",
            f"remove the memlock and nofile lines from {PAM_LIMITS}: {PAM_DROPIN} sets them",
        )
    return passed(f"only {PAM_DROPIN} sets memlock and nofile")


# The variables read as typed (the last assignment of each wins): /etc/default/grub alone, which
# tpuboot's strict reader (parsers/grub.py) refuses on stock images whose GRUB_DISTRIBUTOR runs a
# command it cannot read past (Ubuntu 24.04's); the line they make is split as GRUB splits it.
_GRUB_CMDLINE = re.compile(r"""^\s*(GRUB_CMDLINE_LINUX(?:_DEFAULT)?)=(?:"([^"]*)"|'([^']*)'|(\S*))""", re.M)


def _typed_in_grub_default(text: str) -> NextBoot:
    line: dict[str, str] = {}
    for match in _GRUB_CMDLINE.finditer(text):  # the last assignment of each variable wins
        line[match.group(1)] = next(g for g in match.groups()[1:] if g is not None)
    linux, default = (line.get(name, "") for name in CMDLINE_VARS)
    return NextBoot(linux, default, (GRUB_DEFAULT,))


GRUB_EDITS = Criterion("leftover-grub-cmdline", "no TPU kernel parameter typed into /etc/default/grub")


def check_leftover_grub(root: Root) -> CheckResult:
    """TPU parameters typed into /etc/default/grub. tpuboot's drop-in adds a parameter only if it
    is not set, so a wrong value there wins (the documented THP sed, run after the IOMMU one,
    gives ``intel_iommu=on transparent_hugepage=always,sm_on``): FAIL. Right values only
    duplicate the drop-in's, but stay after ``apt purge tpuboot``: WARN."""
    text = read_text(root, GRUB_DEFAULT)
    if text is None:
        return passed(f"no {GRUB_DEFAULT}: no parameter typed there")
    try:
        params = _typed_in_grub_default(text).params()
    except Unreadable as exc:
        return warned(f"cannot tell which parameters {GRUB_DEFAULT} sets: {exc}", "see the detail")
    set_here: dict[str, list[str]] = {}
    for param in params:
        if param.name in TPU_PARAMS:
            set_here.setdefault(param.name, []).append(param.value or "")
    if not set_here:
        return passed(f"{GRUB_DEFAULT} sets no TPU kernel parameter")
    wrong = {name: values for name, values in set_here.items() if not param_ok(name, values)}
    shown = " ".join(f"{name}={v}" for name, values in set_here.items() for v in values)
    if wrong:
        want = " ".join(word(name) for name in wrong)
        return failed(
            f"{GRUB_DEFAULT} sets {shown}; tpuboot's drop-in then adds nothing for {', '.join(wrong)}",
            f"remove {' '.join(f'{n}={v}' for n, vs in wrong.items() for v in vs)} from {GRUB_DEFAULT} "
            f"(tpuboot's {TPUBOOT_DROPIN} adds {want}), update-grub, reboot",
        )
    if not root.path(TPUBOOT_DROPIN).exists():
        return passed(f"{GRUB_DEFAULT} sets {shown} (no {TPUBOOT_DROPIN}: they are needed there)")
    return warned(
        f"{GRUB_DEFAULT} sets {shown}, as {TPUBOOT_DROPIN} does",
        f"remove {shown} from {GRUB_DEFAULT}, update-grub: {TPUBOOT_DROPIN} adds them (and purge removes it)",
    )


ENVIRONMENT = "/etc/environment"


ENVIRONMENT_DUPLICATES = Criterion(
    "leftover-environment-duplicates", "no key assigned more than once in /etc/environment"
)


def check_leftover_environment_duplicates(root: Root) -> CheckResult:
    """Keys assigned more than once in /etc/environment (the documented scripts appended at
    every boot): pam_env reads the last, so the lines are only noise while they agree (WARN)."""
    text = read_text(root, ENVIRONMENT)
    if text is None:
        return passed(f"no {ENVIRONMENT}: no line repeated")
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = PAM_ASSIGNMENT.match(line)
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


CHECKS: tuple[tuple[Criterion, Check], ...] = (
    (VFIO_BINDER, check_leftover_vfio_binder),
    (ACCEL_RULE, check_leftover_accel_rule),
    (TPU_ENV_WRITER, check_leftover_tpu_env_writer),
    (ENVIRONMENT_APPENDER, check_leftover_environment_appender),
    (METADATA_SCRIPT, check_leftover_metadata_script),
    (LIMITS_CONF, check_leftover_limits),
    (GRUB_EDITS, check_leftover_grub),
    (ENVIRONMENT_DUPLICATES, check_leftover_environment_duplicates),
)
