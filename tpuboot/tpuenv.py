"""tpu-env: the ``tpu-env`` metadata attribute (YAML) turned into the shell file the TPU runtime sources.

The documented script ``eval``-ed text built from the values, so a value holding ``"``,
``$(...)`` or a backtick ran as a command. Here the YAML is checked before it is loaded
(no anchors or aliases, so no alias bomb; bounded size and depth), only a mapping of
shell-variable names to scalars is accepted, and every value is escaped so that
``set -a; . FILE`` in dash or bash yields exactly the original string.

Rendering of YAML scalars: strings as they are; ``true``/``false`` (and YAML 1.1's
yes/no/on/off) as ``true``/``false``; null or an empty value as the empty string;
numbers with Python's ``str()`` (``0x10`` becomes ``16``: quote values in tpu-env to keep
them verbatim); dates as ISO 8601. Skipped, all named in one warning: keys that are not
shell variable names, names the shells give a meaning (``PATH``, ``IFS``, ``LD_*``...),
nested values, binary values, and values a shell variable cannot hold (NUL).
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from tpuboot.errors import TpubootError

log = logging.getLogger("tpuboot.tpuenv")

#: Real tpu-env values are about 1 KiB; this bounds parse time and memory.
MAX_TPU_ENV_BYTES = 1 << 20
#: Nesting allowed in the YAML at all (nested values are skipped anyway); stops deep-nesting recursion.
MAX_DEPTH = 16

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Variables dash or bash interpret (parsing, startup files, loader, locale) or keep read-only.
_SHELL_NAME_LIST = (
    "CDPATH COLUMNS DIRSTACK ENV EPOCHREALTIME EPOCHSECONDS EUID FCEDIT FUNCNAME GLOBIGNORE GROUPS HOME "
    "HOSTFILE IFS IGNOREEOF INPUTRC LANG LINENO LINES MAIL MAILCHECK MAILPATH OLDPWD OPTARG OPTERR OPTIND "
    "PATH POSIXLY_CORRECT PPID PROMPT_COMMAND PS0 PS1 PS2 PS3 PS4 PWD RANDOM SECONDS SHELL SHELLOPTS SHLVL "
    "SRANDOM TERM TMOUT UID"
)
_SHELL_NAMES = frozenset(_SHELL_NAME_LIST.split())
_SHELL_PREFIXES = ("BASH", "LD_", "LC_", "COMP_", "HIST", "READLINE_")


class TpuEnvError(TpubootError):
    """The tpu-env value cannot be used at all (not YAML, not a mapping, aliases, too large)."""


@dataclass(frozen=True)
class TpuEnv:
    """The usable variables, in source order, and what was skipped (key → reason)."""

    values: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)


def parse_tpu_env(text: str | bytes, *, max_bytes: int = MAX_TPU_ENV_BYTES) -> TpuEnv:
    """Parse a tpu-env value; raises TpuEnvError if it is unusable, warns once about skipped keys."""
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise TpuEnvError(f"tpu-env is larger than {max_bytes} bytes; shrink the tpu-env attribute")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise TpuEnvError("tpu-env is not UTF-8 text; fix the tpu-env attribute") from None
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise TpuEnvError(f"tpu-env is larger than {max_bytes} bytes; shrink the tpu-env attribute")
    _check_events(text)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TpuEnvError(f"tpu-env is not valid YAML{_where(exc)}; fix the tpu-env attribute") from None
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise TpuEnvError(f"tpu-env is {kind}, not a mapping of NAME: 'value'; fix the tpu-env attribute")
    env = _convert(data)
    if env.skipped:
        listed = ", ".join(f"{key} ({why})" for key, why in env.skipped.items())
        log.warning(
            "tpu-env: skipped %d of %d keys: %s",
            len(env.skipped),
            len(data),
            listed,
            extra={"TPU_ENV_SKIPPED": " ".join(env.skipped)},
        )
    return env


def _where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" (line {mark.line + 1})" if mark is not None else ""


def _check_events(text: str) -> None:
    """Refuse anchors, aliases and deep nesting before anything is constructed from them."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise TpuEnvError(
                    "tpu-env uses YAML anchors or aliases (& or *), refused to prevent alias bombs; "
                    "write each value out"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise TpuEnvError(
                        f"tpu-env nests deeper than {MAX_DEPTH} levels; flatten the tpu-env attribute"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        raise TpuEnvError(f"tpu-env is not valid YAML{_where(exc)}; fix the tpu-env attribute") from None


def _convert(data: Mapping[Any, Any]) -> TpuEnv:
    values: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for key, raw in data.items():
        value = scalar_text(raw)
        why = _key_problem(key) or _value_problem(raw, value)
        if why is None and value is not None:
            values[key] = value
        else:
            label = key if isinstance(key, str) and _NAME.match(key) else repr(key)
            skipped[label] = why or "unusable"
    return TpuEnv(values, skipped)


def _key_problem(key: Any) -> str | None:
    if not isinstance(key, str) or not _NAME.match(key):
        return "not a shell variable name"
    if key in _SHELL_NAMES or key.startswith(_SHELL_PREFIXES):
        return "reserved by the shell"
    return None


def _value_problem(raw: Any, value: str | None) -> str | None:
    if value is None:
        return f"a {type(raw).__name__}, not a scalar"
    if "\0" in value:
        return "contains NUL, which a shell variable cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode"
    return None


def scalar_text(value: Any) -> str | None:
    """The text a YAML scalar stands for in the environment (None for non-scalars); see module doc."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    return None


_ESCAPE = str.maketrans({"\\": "\\\\", '"': '\\"', "$": "\\$", "`": "\\`"})


def shell_quote(value: str) -> str:
    """``value`` in double quotes, read back verbatim by any POSIX shell (NUL is not allowed)."""
    if "\0" in value:
        raise ValueError("a shell variable cannot hold NUL")
    return '"' + value.translate(_ESCAPE) + '"'


def render_env_file(values: Mapping[str, str]) -> str:
    """The tpu-env file: one ``KEY="value"`` assignment per key, for ``set -a; . FILE``."""
    return "".join(f"{key}={shell_quote(value)}\n" for key, value in values.items())


_ASSIGNMENT = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\[\\"$`])*)"\n')


def parse_env_file(text: str) -> dict[str, str] | None:
    """The inverse of :func:`render_env_file`; None if any line is not such an assignment (a file
    someone else wrote, or garbled)."""
    values: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _ASSIGNMENT.match(text, pos)
        if match is None:
            return None
        values[match.group(1)] = re.sub(r"\\(.)", r"\1", match.group(2), flags=re.S)
        pos = match.end()
    return values
