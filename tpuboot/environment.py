"""/etc/environment: set tpuboot's keys in place, once each, and leave every other byte alone.

The documented scripts appended ``KEY=value`` at every boot, so the file grew a duplicate per
reboot. Here each configured key (config ``env.environment``) is set key by key: an existing
assignment with the right value is kept byte for byte, a wrong one is replaced where it
stands, later duplicates of our keys are dropped, missing keys are appended. Other lines,
comments and line endings stay as they were; an unchanged file is not rewritten.

Syntax is pam_env's (``KEY=value`` or ``KEY="value"``, optional ``export``, ``#`` comments,
a trailing backslash continues a line). Values are quoted only when needed; values pam_env
and a shell would read differently (quotes, backslash, ``$``, backtick, newline) are refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from tpuboot.atomicfile import read_file, write_file
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.environment")

#: /etc/environment is a few hundred bytes; refuse to load something absurd into memory.
MAX_ENVIRONMENT_BYTES = 1 << 20

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ASSIGNMENT = re.compile(r"[ \t]*(?:export[ \t]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z", re.DOTALL)
_BARE = re.compile(r"[A-Za-z0-9_./:,@%+=-]+\Z")
_UNREPRESENTABLE = frozenset('"\\$`\n\r\0')


def format_assignment(key: str, value: str) -> str:
    """``KEY=value``, quoted only when the value needs it; ConfigError if it cannot be written."""
    if not _NAME.match(key):
        raise ConfigError(f"env.environment: {key!r} is not a variable name; use letters, digits and _")
    bad = sorted(_UNREPRESENTABLE.intersection(value))
    if bad:
        raise ConfigError(
            f"env.environment.{key}: the value holds {', '.join(map(repr, bad))}, which /etc/environment "
            "cannot carry; remove it"
        )
    return f"{key}={value}" if _BARE.match(value) else f'{key}="{value}"'


def _value_of(text: str) -> str:
    """The value pam_env reads from the text after ``=``."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


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


def merge_environment(text: str, wanted: Mapping[str, str]) -> tuple[str, list[str]]:
    """The file text with ``wanted`` set, and the keys whose lines changed (empty: text unchanged)."""
    assignments = {key: format_assignment(key, value) for key, value in wanted.items()}
    out: list[str] = []
    seen: set[str] = set()
    changed: list[str] = []
    for line in _logical_lines(text):
        body = line.removesuffix("\n")
        match = _ASSIGNMENT.match(body.replace("\\\n", ""))
        key = match.group(1) if match else None
        if match is None or key not in wanted:
            out.append(line)
        elif key in seen:
            changed.append(key)  # a duplicate of ours: dropped
        else:
            seen.add(key)
            if _value_of(match.group(2)) == wanted[key]:
                out.append(line)
            else:
                out.append(assignments[key] + line[len(body) :])
                changed.append(key)
    missing = [key for key in wanted if key not in seen]
    if missing:
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        if out and out[-1].endswith("\\\n"):
            out.append("\n")  # end the backslash-continued line before ours
        out.extend(assignments[key] + "\n" for key in missing)
        changed.extend(missing)
    return "".join(out), list(dict.fromkeys(changed))


def ensure_environment(root: Root, path: str, wanted: Mapping[str, str]) -> dict[str, str]:
    """Make ``path`` (normally /etc/environment) set ``wanted``; the lines written, by key
    (empty: the file was left as it was)."""
    raw = read_file(root, path, limit=MAX_ENVIRONMENT_BYTES)
    text = (raw or b"").decode("utf-8", "surrogateescape")
    merged, changed = merge_environment(text, wanted)
    if not changed or not write_file(root, path, merged.encode("utf-8", "surrogateescape")):
        return {}
    log.info(
        "%s: set %s",
        path,
        ", ".join(changed),
        extra={"ENVIRONMENT_PATH": path, "ENVIRONMENT_KEYS": " ".join(changed)},
    )
    return {key: format_assignment(key, wanted[key]) for key in changed}


def record_written_lines(root: Root, record: str, lines: Mapping[str, str]) -> None:
    """Add ``lines`` (key -> the line written) to ``record``, one line each, the latest per key.

    The package's purge removes exactly these lines from /etc/environment, if still there as
    written: keys that were already right before tpuboot, or edited since, are the admin's.
    """
    raw = read_file(root, record, limit=MAX_ENVIRONMENT_BYTES)
    kept = {}
    for line in (raw or b"").decode("utf-8", "surrogateescape").splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            kept[match.group(1)] = line
    merged = {**kept, **lines}
    if merged != kept:
        data = "".join(line + "\n" for line in merged.values())
        write_file(root, record, data.encode("utf-8", "surrogateescape"), mode=0o600)
