"""/etc/environment: add tpuboot's keys, never override or lose an admin's, leave every other byte alone.

Decision: **an admin's value wins.** A key tpuboot manages (config
``env.environment``) that an admin has set stays as the admin wrote it, whatever its value:
tpuboot only adds a key that is absent, as the documented configure-env-vars.sh does for
CLOUDSDK_PYTHON. (The documented configure-gcs-timeouts.sh appends its GCS lines at every boot,
so its last line overrides an admin's; tpuboot deliberately does not.) An admin who set a GCS
timeout meant it: tpuboot logs once that it kept it, and doctor shows it (the plan's ``admin``).
Recording and restoring replaced values was rejected: the admin may edit the file between boot
and purge, and a restore would put back a value the admin has since changed. With this rule
there is nothing to restore: tpuboot never rewrites a line it did not write, so purge only
removes tpuboot's own.

Ownership comes from the record (``ENVIRONMENT_RECORD``, read by debian/tpuboot.postrm): a line
is tpuboot's while it stands byte for byte as recorded. Per key:

- no assignment (a comment is none): tpuboot appends ``KEY=value`` and records it;
- only tpuboot's line: kept, or replaced where it stands when the configured value changed;
- any other assignment (set before tpuboot, tpuboot's line edited or respelled, a line added):
  the key is the admin's. tpuboot removes its own line if one is left (so the admin's value is
  the one read), forgets the key, and leaves the admin's lines alone, except that repeats of one
  line (the documented scripts appended one per boot) collapse into the first: the value read is
  the same, and that line stays at purge.

The record is updated before the file (keys given up are forgotten, new lines added) and
trimmed after it, so a crash in between can leave a tpuboot line unrecorded (it then counts as
the admin's and stays at purge), never an admin's line recorded. Limits: a line tpuboot wrote
that an admin deleted and retyped identically is taken for tpuboot's and goes at purge; a key
dropped from env.environment keeps tpuboot's line until purge.

Syntax is pam_env's (``KEY=value`` or ``KEY="value"``, optional ``export``, ``#`` comments,
a trailing backslash continues a line; the last assignment of a key is the one read). Values are
quoted only when needed; values pam_env and a shell would read differently (quotes, backslash,
``$``, backtick, newline, and ``#``, where pam_env ends every value) are refused, and so are the
Unicode noncharacters systemd's environment.d generator refuses (Debian's systemd links
/etc/environment into environment.d: one would cost every user manager the whole file). A
refused key is left out of the file alone, named in one warning; the others are written.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from tpuboot.atomicfile import read_file, write_file
from tpuboot.env.assignment import PAM_ASSIGNMENT, WHOLE_NAME
from tpuboot.env.tpuenv import systemd_problem
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.env.etc_environment")

#: The lines tpuboot wrote and still owns, one a line. Where debian/tpuboot.postrm reads them,
#: whatever env.cache_dir says: the package's purge knows only this path.
ENVIRONMENT_RECORD = "/var/lib/tpuboot/environment.lines"
RECORD_MODE = 0o600

_BARE = re.compile(r"[A-Za-z0-9_./:,@%+=-]+\Z")
# pam_env ends a line's value at its first "#", quoted or not (Linux-PAM 1.5's _parse_env_file, as
# tests/unit/env/test_envfile_consumers.py finds): a value holding one cannot be carried either.
_UNREPRESENTABLE = frozenset('"\\$`#\n\r\0')

# (path, key, admin's value, tpuboot's value) already logged: said once per process, not per sync.
_reported: set[tuple[str, str, str, str]] = set()
_reported_lock = threading.Lock()


def format_assignment(key: str, value: str) -> str:
    """``KEY=value``, quoted only when the value needs it; ConfigError if it cannot be written."""
    if not WHOLE_NAME.match(key):
        raise ConfigError(f"env.environment: {key!r} is not a variable name; use letters, digits and _")
    bad = sorted(_UNREPRESENTABLE.intersection(value))
    if bad:
        raise ConfigError(
            f"env.environment.{key}: the value holds {', '.join(map(repr, bad))}, which /etc/environment "
            "cannot carry; remove it"
        )
    refused = systemd_problem(key, value)
    if refused:  # systemd's environment.d generator reads /etc/environment (Debian links it there)
        raise ConfigError(f"env.environment.{key}: the value {refused}; remove it")
    return f"{key}={value}" if _BARE.match(value) else f'{key}="{value}"'


def _value_of(text: str) -> str:
    """The value pam_env reads from the text after ``=``."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _read_value(assignment: str) -> str:
    """The value pam_env reads from a (joined) assignment line."""
    match = PAM_ASSIGNMENT.match(assignment)
    return _value_of(match.group(2)) if match else ""


def _logical_lines(text: str) -> list[str]:
    """Lines as pam_env reads them, newlines kept: ``\\n`` ends one, a trailing backslash joins the next."""
    physical = re.findall(r"[^\n]*\n|[^\n]+\Z", text)
    logical: list[str] = []
    joining = False
    for line in physical:
        if joining:
            logical[-1] += line
        else:
            logical.append(line)
        joining = line.removesuffix("\n").endswith("\\")
    return logical


def _joined(line: str) -> str:
    """One logical line as read: continuations joined, and a backslash that ends the file (there
    is no next line to join) dropped, so a line reads the same before and after one is appended."""
    return line.removesuffix("\n").replace("\\\n", "").removesuffix("\\")


@dataclass(frozen=True)
class EnvironmentPlan:
    """What setting ``wanted`` does to one /etc/environment text, given tpuboot's recorded lines."""

    text: str
    #: Keys whose lines changed (empty: ``text`` is the input unchanged).
    changed: list[str] = field(default_factory=list)
    #: key -> the line tpuboot writes now (appended or replaced in place).
    written: dict[str, str] = field(default_factory=dict)
    #: key -> tpuboot's line standing in ``text``: the record's new content for these keys.
    owned: dict[str, str] = field(default_factory=dict)
    #: Keys the admin has set: tpuboot's record of them is dropped.
    released: list[str] = field(default_factory=list)
    #: key -> (the admin's value read, tpuboot's value), where they differ.
    admin: dict[str, tuple[str, str]] = field(default_factory=dict)


def plan_environment(
    text: str, wanted: Mapping[str, str], recorded: Mapping[str, frozenset[str]] | None = None
) -> EnvironmentPlan:
    """Set ``wanted`` in ``text``; ``recorded``: key -> the lines tpuboot wrote (None: none known)."""
    recorded = recorded or {}
    assignments = {key: format_assignment(key, value) for key, value in wanted.items()}
    lines = _logical_lines(text)
    by_key: dict[str, list[int]] = {}
    for index, line in enumerate(lines):
        match = PAM_ASSIGNMENT.match(_joined(line))
        if match and match.group(1) in wanted:
            by_key.setdefault(match.group(1), []).append(index)

    drop: set[int] = set()
    replace: dict[int, str] = {}
    written: dict[str, str] = {}
    owned: dict[str, str] = {}
    released: list[str] = []
    admin: dict[str, tuple[str, str]] = {}
    changed: list[str] = []
    for key, indexes in by_key.items():
        mine = recorded.get(key, frozenset())
        ours = next((i for i in indexes if lines[i].removesuffix("\n") in mine), None)
        theirs = [i for i in indexes if i != ours]
        if ours is not None and not theirs:  # only tpuboot's own line: follow the configuration
            body = lines[ours].removesuffix("\n")
            if _read_value(body) == wanted[key]:
                owned[key] = body
            else:
                replace[ours] = assignments[key]
                written[key] = owned[key] = assignments[key]
                changed.append(key)
            continue
        if key in recorded:
            released.append(key)
        if ours is not None:
            drop.add(ours)
            changed.append(key)
        first = _joined(lines[theirs[0]])
        if all(_joined(lines[i]) == first for i in theirs[1:]) and len(theirs) > 1:
            drop.update(theirs[1:])  # repeats of one line: the value read is the same
            changed.append(key)
        value = _read_value(_joined(lines[theirs[-1]]))  # the last assignment is the one read
        if value != wanted[key]:
            admin[key] = (value, wanted[key])

    out: list[str] = []
    for index, line in enumerate(lines):
        if index in drop:
            continue
        if index in replace:
            body = line.removesuffix("\n")
            line = replace[index] + line[len(body) :]
        out.append(line)
    missing = [key for key in wanted if key not in by_key]
    if missing:
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        if out and out[-1].endswith("\\\n"):
            out.append("\n")  # end the backslash-continued line before ours
        for key in missing:
            out.append(assignments[key] + "\n")
            written[key] = owned[key] = assignments[key]
        changed.extend(missing)
    changed = list(dict.fromkeys(changed))
    return EnvironmentPlan("".join(out) if changed else text, changed, written, owned, released, admin)


def read_record(root: Root, record: str = ENVIRONMENT_RECORD) -> dict[str, list[str]]:
    """key -> the lines recorded for it, in file order (a missing record: empty)."""
    raw = read_file(root, record)
    lines: dict[str, list[str]] = {}
    for line in (raw or b"").decode("utf-8", "surrogateescape").splitlines():
        match = PAM_ASSIGNMENT.match(line)
        if match and line not in lines.get(match.group(1), []):
            lines.setdefault(match.group(1), []).append(line)
    return lines


def _write_record(root: Root, record: str, lines: Mapping[str, list[str]]) -> None:
    data = "".join(line + "\n" for key_lines in lines.values() for line in key_lines)
    write_file(root, record, data.encode("utf-8", "surrogateescape"), mode=RECORD_MODE)


def ensure_environment(
    root: Root, path: str, wanted: Mapping[str, str], record: str = ENVIRONMENT_RECORD
) -> dict[str, str]:
    """Make ``path`` (normally /etc/environment) set ``wanted`` where no admin has set it; the
    lines tpuboot wrote, by key (empty: none written). ``record`` is kept in step."""
    wanted = _writable(path, wanted)
    raw = read_file(root, path)
    text = (raw or b"").decode("utf-8", "surrogateescape")
    recorded = read_record(root, record)
    plan = plan_environment(text, wanted, {key: frozenset(lines) for key, lines in recorded.items()})
    _report_admin_values(path, plan.admin)
    # Exactly the lines standing as tpuboot's, plus keys it no longer manages as they were.
    after = {key: lines for key, lines in recorded.items() if key not in wanted}
    after.update({key: [line] for key, line in plan.owned.items()})
    if not plan.changed:
        if after != recorded:  # the admin took a key over: forget it
            _write_record(root, record, after)
        return {}
    # Before the file: forget what the admin took over, add what is about to be written.
    before = {key: lines for key, lines in recorded.items() if key not in plan.released}
    for key, line in plan.written.items():
        before[key] = [*before.get(key, []), *([] if line in before.get(key, []) else [line])]
    if before != recorded:
        _write_record(root, record, before)
    wrote = write_file(root, path, plan.text.encode("utf-8", "surrogateescape"))
    if after != before:
        _write_record(root, record, after)
    if wrote:
        log.info(
            "%s: set %s",
            path,
            ", ".join(plan.changed),
            extra={"ENVIRONMENT_PATH": path, "ENVIRONMENT_KEYS": " ".join(plan.changed)},
        )
    return dict(plan.written)


def _writable(path: str, wanted: Mapping[str, str]) -> dict[str, str]:
    """``wanted`` less the keys /etc/environment cannot carry, named once: one bad value must not
    cost the file every other key."""
    kept: dict[str, str] = {}
    refused: dict[str, str] = {}
    for key, value in wanted.items():
        try:
            format_assignment(key, value)
        except ConfigError as exc:
            refused[key] = str(exc)
            continue
        kept[key] = value
    if refused:
        with _reported_lock:
            said = (path, "", repr(sorted(refused.items())), "")
            new = said not in _reported
            _reported.add(said)
        if new:
            log.warning(
                "%s: left out %s: %s",
                path,
                ", ".join(refused),
                "; ".join(refused.values()),
                extra={"ENVIRONMENT_PATH": path, "ENVIRONMENT_KEYS": " ".join(refused)},
            )
    return kept


def _report_admin_values(path: str, admin: Mapping[str, tuple[str, str]]) -> None:
    """Say once per process that an admin's value is kept where tpuboot's would differ."""
    for key, (theirs, ours) in admin.items():
        with _reported_lock:
            if (path, key, theirs, ours) in _reported:
                continue
            _reported.add((path, key, theirs, ours))
        log.warning(
            "%s: kept the admin's %s=%r (tpuboot's value: %r); remove that line to let tpuboot set it",
            path,
            key,
            theirs,
            ours,
            extra={"ENVIRONMENT_PATH": path, "ENVIRONMENT_KEYS": key},
        )
