"""tpu-env: the ``tpu-env`` metadata attribute (YAML) turned into the shell file the TPU runtime sources.

The documented script ``eval``-ed text built from the values, so a value holding ``"``,
``$(...)`` or a backtick ran as a command. Here the YAML is checked before it is read
(no anchors or aliases, so no alias bomb; bounded size and depth), only a mapping of
shell-variable names to scalars is accepted, and every value is escaped so that
``set -a; . FILE`` in dash or bash yields exactly the original string.

Values are the text written, not YAML 1.1's typing: the document is only composed into
nodes (never constructed into Python objects, which raises ValueError, IndexError,
KeyError... on scalars such as ``2026-02-30``, ``!!int ''`` or a 5000-digit number), and
each value is its scalar's text. The runtime reads strings, so ``0123``, ``1:30``, ``0x10``,
``yes``, ``1.50`` and ``~`` stay as written (YAML 1.1 would give 83, 90, 16, True, 1.5 and
None); quoted values, all a real tpu-env holds, are the same either way. Tags of YAML's own
scalar types (``!!str``, ``!!int``...) change nothing; a value with any other tag
(``!!binary``, ``!!python/...``, ``!local``) is skipped.

Skipped, all named in one warning: keys that are not shell variable names, names in
:data:`REFUSED_NAMES` (what bash, dash or the dynamic loader give a meaning), nested or
tagged values, values a shell variable cannot hold (NUL, unpaired surrogates), values
over the kernel's limit for one environment string (:data:`MAX_ENV_STRING`), and values
past the whole file's bound (:data:`MAX_ENV_TOTAL`).

The systemd and docker renderings each leave out what their reader cannot take whole
(:func:`systemd_problem`, :func:`docker_problem`): that value is missing from that file alone,
and the caller names it in one warning; tpu-env itself keeps it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import yaml

from tpuboot.env.assignment import NAME, WHOLE_NAME
from tpuboot.errors import TpubootError, shown
from tpuboot.paths import MAX_FILE_BYTES

log = logging.getLogger("tpuboot.env.tpuenv")

#: Real tpu-env values are about 1 KiB; this bounds parse time and memory.
MAX_TPU_ENV_BYTES = MAX_FILE_BYTES
#: Nesting allowed in the YAML at all (nested values are skipped anyway); stops deep-nesting recursion.
MAX_DEPTH = 16
#: The kernel's limit on one environment string, ``NAME=value`` and its NUL: MAX_ARG_STRLEN, 32
#: pages of 4 KiB (include/uapi/linux/binfmts.h). A longer one makes every execve() of a script
#: that sourced the file fail with E2BIG ("Argument list too long").
MAX_ENV_STRING = 32 * 4096
#: The whole file's bound, counted as execve() does (each string, its NUL and an 8-byte pointer):
#: a quarter of the 2 MiB the kernel allows arguments and environment together under the default
#: 8 MiB stack limit, so the runtime's own environment and command lines keep the rest.
MAX_ENV_TOTAL = 512 * 1024
_POINTER = 8


# Every name a shell or the loader gives a meaning, by exact name (no prefix rule: LC_PAPER,
# BASHFUL or HISTORY_DAYS mean nothing to them and are kept). The shells read such a name to
# decide what to run or how to parse (PATH, ENV, BASH_ENV, IFS, SHELLOPTS, PS4, LC_CTYPE...),
# or set it themselves so the runtime would not see the value written (RANDOM, LINENO, PWD,
# SHLVL, _...), or keep it read-only so the assignment fails and ends a ``set -e`` script
# (EUID, UID, PPID, BASHOPTS...). Exported functions (``BASH_FUNC_name%%``) are not names at all.
_REFUSED_BY_SOURCE: tuple[tuple[str, str], ...] = (
    (
        "bash(1) 5.2, Shell Variables",
        "_ BASH BASHOPTS BASHPID BASH_ALIASES BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS BASH_COMMAND "
        "BASH_EXECUTION_STRING BASH_LINENO BASH_LOADABLES_PATH BASH_REMATCH BASH_SOURCE BASH_SUBSHELL "
        "BASH_VERSINFO BASH_VERSION COMP_CWORD COMP_KEY COMP_LINE COMP_POINT COMP_TYPE COMP_WORDBREAKS "
        "COMP_WORDS COPROC DIRSTACK EPOCHREALTIME EPOCHSECONDS EUID FUNCNAME GROUPS HISTCMD HOSTNAME "
        "HOSTTYPE LINENO MACHTYPE MAPFILE OLDPWD OPTARG OPTIND OSTYPE PIPESTATUS PPID PWD RANDOM "
        "READLINE_ARGUMENT READLINE_LINE READLINE_MARK READLINE_POINT REPLY SECONDS SHELLOPTS SHLVL "
        "SRANDOM UID BASH_COMPAT BASH_ENV BASH_XTRACEFD CDPATH CHILD_MAX COLUMNS COMPREPLY EMACS ENV "
        "EXECIGNORE FCEDIT FIGNORE FUNCNEST GLOBIGNORE HISTCONTROL HISTFILE HISTFILESIZE HISTIGNORE "
        "HISTSIZE HISTTIMEFORMAT HOME HOSTFILE IFS IGNOREEOF INPUTRC INSIDE_EMACS LANG LC_ALL "
        "LC_COLLATE LC_CTYPE LC_MESSAGES LC_NUMERIC LC_TIME LINES MAIL MAILCHECK MAILPATH OPTERR PATH "
        "POSIXLY_CORRECT PROMPT_COMMAND PROMPT_DIRTRIM PS0 PS1 PS2 PS3 PS4 SHELL TIMEFORMAT TMOUT "
        "TMPDIR auto_resume histchars",
    ),
    ("bash(1) 5.3, Shell Variables", "BASH_MONOSECONDS BASH_TRAPSIG GLOBSORT"),
    ("bash(1), fc", "EDITOR"),
    (
        "dash(1), Environment and fc",
        "HOME PATH CDPATH MAIL MAILCHECK MAILPATH PS1 PS2 PS4 IFS TERM HISTSIZE PWD OLDPWD PPID "
        "ENV OPTARG OPTIND FCEDIT EDITOR",
    ),
    (
        "ld.so(8), ENVIRONMENT",
        "LD_ASSUME_KERNEL LD_BIND_NOW LD_LIBRARY_PATH LD_PRELOAD LD_TRACE_LOADED_OBJECTS LD_AUDIT "
        "LD_BIND_NOT LD_DEBUG LD_DEBUG_OUTPUT LD_DYNAMIC_WEAK LD_HWCAP_MASK LD_ORIGIN_PATH "
        "LD_POINTER_GUARD LD_PREFER_MAP_32BIT_EXEC LD_PROFILE LD_PROFILE_OUTPUT LD_SHOW_AUXV "
        "LD_TRACE_PRELINKING LD_USE_LOAD_BIAS LD_VERBOSE LD_WARN",
    ),
    (
        "ld.so(8), secure-execution mode",
        "GCONV_PATH GETCONF_DIR HOSTALIASES LOCALDOMAIN LOCPATH MALLOC_TRACE NIS_PATH NLSPATH "
        "RESOLV_HOST_CONF RES_OPTIONS TMPDIR TZDIR",
    ),
    (
        "mallopt(3), ENVIRONMENT; glibc manual, Tunables",
        "GLIBC_TUNABLES MALLOC_ARENA_MAX MALLOC_ARENA_TEST MALLOC_CHECK_ MALLOC_MMAP_MAX_ "
        "MALLOC_MMAP_THRESHOLD_ MALLOC_PERTURB_ MALLOC_TOP_PAD_ MALLOC_TRIM_THRESHOLD_",
    ),
)


def _by_name() -> dict[str, str]:
    names: dict[str, list[str]] = {}
    for source, listed in _REFUSED_BY_SOURCE:
        for name in listed.split():
            names.setdefault(name, []).append(source)
    return {name: "; ".join(sources) for name, sources in sorted(names.items())}


#: The names tpu-env may not set, each with the documentation that gives it a meaning.
REFUSED_NAMES: Mapping[str, str] = MappingProxyType(_by_name())

_YAML = "tag:yaml.org,2002:"
# Tags that only say how YAML 1.1 would type the text; the text is taken as written.
_TEXT_TAGS = frozenset(_YAML + kind for kind in ("str", "int", "float", "bool", "null", "timestamp"))


class TpuEnvError(TpubootError):
    """The tpu-env value cannot be used at all (not YAML, not a mapping, aliases, too large)."""


@dataclass(frozen=True)
class TpuEnv:
    """The usable variables, in source order, and what was skipped (key → reason)."""

    values: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)


def parse_tpu_env(text: str | bytes, *, max_bytes: int = MAX_TPU_ENV_BYTES) -> TpuEnv:
    """Parse a tpu-env value; raises TpuEnvError (one line) if it is unusable, warns once about
    skipped keys. Any other exception is a bug in tpuboot, never a property of the document."""
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise TpuEnvError(f"tpu-env is larger than {max_bytes} bytes; shrink the tpu-env attribute")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise TpuEnvError("tpu-env is not UTF-8 text; fix the tpu-env attribute") from None
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise TpuEnvError(f"tpu-env is larger than {max_bytes} bytes; shrink the tpu-env attribute")
    root = _compose(text)
    if not isinstance(root, yaml.MappingNode) or root.tag != _YAML + "map":
        raise TpuEnvError(
            f"tpu-env is {_kind(root)}, not a mapping of NAME: 'value'; fix the tpu-env attribute"
        )
    env = _convert(root)
    if env.skipped:
        listed = ", ".join(f"{key} ({why})" for key, why in env.skipped.items())
        log.warning(
            "tpu-env: skipped %d of %d keys: %s",
            len(env.skipped),
            len(env.skipped) + len(env.values),
            listed,
            extra={"TPU_ENV_SKIPPED": " ".join(env.skipped)},
        )
    return env


def _kind(node: yaml.Node | None) -> str:
    if node is None:
        return "empty"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.ScalarNode) and node.tag in _TEXT_TAGS:
        return "a single value"
    return f"tagged {_short_tag(node.tag)}"


def _short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML) :] if tag.startswith(_YAML) else tag


def _where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" (line {mark.line + 1})" if mark is not None else ""


def _compose(text: str) -> yaml.Node | None:
    """The document's node tree, after refusing anchors, aliases and deep nesting.

    Composing resolves no values, so no constructor runs. PyYAML's reader and parser raise
    only YAMLError on the inputs tried; anything else is still one refusal, not a traceback.
    """
    loader = _CheckedLoader(text)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as exc:
        raise TpuEnvError(f"tpu-env is not valid YAML{_where(exc)}; fix the tpu-env attribute") from None
    except (ValueError, TypeError, LookupError, ArithmeticError, RecursionError) as exc:
        log.debug("PyYAML failed on tpu-env", exc_info=True)
        raise TpuEnvError(
            f"tpu-env could not be read by the YAML parser ({type(exc).__name__}); fix the tpu-env attribute"
        ) from None
    finally:
        loader.dispose()


class _CheckedLoader(yaml.SafeLoader):
    """Refuses anchors, aliases and deep nesting as the composer takes each event, before it
    composes anything from them: one pass over the document (checking the events in a pass of
    their own, then composing, parsed it twice: 60 000 tiny keys took 3 s)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0

    def get_event(self) -> yaml.Event:
        event: yaml.Event = super().get_event()  # type: ignore[no-untyped-call]  # untyped in the stubs
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise TpuEnvError(
                "tpu-env uses YAML anchors or aliases (& or *), refused to prevent alias bombs; "
                "write each value out"
            )
        if isinstance(event, yaml.CollectionStartEvent):
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise TpuEnvError(
                    f"tpu-env nests deeper than {MAX_DEPTH} levels; flatten the tpu-env attribute"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            self._depth -= 1
        return event


def _convert(root: yaml.MappingNode) -> TpuEnv:
    # Like safe_load, a later duplicate key replaces an earlier one (in the earlier one's place).
    pairs: dict[str, tuple[str | None, yaml.Node]] = {}
    for key_node, value_node in root.value:
        name = _text(key_node)
        if name is not None and WHOLE_NAME.match(name):
            pairs[name] = (key_problem(name), value_node)
        else:
            pairs[_label(key_node)] = ("not a shell variable name", value_node)
    values: dict[str, str] = {}
    skipped: dict[str, str] = {}
    total = 0
    for key, (why, value_node) in pairs.items():
        value = _text(value_node)
        why = why or _value_problem(value_node, value)
        if why is None and value is not None:
            size = len(key) + 1 + len(value.encode("utf-8"))  # NAME=value; execve adds a NUL
            if size >= MAX_ENV_STRING:
                why = f"{size} bytes as NAME=value, over the kernel's limit of {MAX_ENV_STRING - 1}"
            elif total + size + 1 + _POINTER > MAX_ENV_TOTAL:
                why = f"past the {MAX_ENV_TOTAL // 1024} KiB bound on the whole tpu-env"
            else:
                total += size + 1 + _POINTER
                values[key] = value
                continue
        skipped[key] = why or "unusable"
    return TpuEnv(values, skipped)


def _text(node: yaml.Node) -> str | None:
    """A scalar's text as written (escapes and line folding applied); None for anything else."""
    if isinstance(node, yaml.ScalarNode) and node.tag in _TEXT_TAGS:
        return str(node.value)
    return None


def _label(node: yaml.Node) -> str:
    """How a key that is not a name is shown in the warning: quoted, and short."""
    if isinstance(node, yaml.ScalarNode):
        return shown(node.value)
    kind = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
    return f"<{kind} key, line {node.start_mark.line + 1}>"


def key_problem(name: str) -> str | None:
    """Why tpu-env may not set ``name`` (a valid shell name), citing the documentation; None if it may."""
    source = REFUSED_NAMES.get(name)
    return f"reserved: {source}" if source is not None else None


def _value_problem(node: yaml.Node, value: str | None) -> str | None:
    if value is None:
        if isinstance(node, yaml.MappingNode):
            return "a mapping, not a scalar"
        if isinstance(node, yaml.SequenceNode):
            return "a list, not a scalar"
        return f"tagged {_short_tag(node.tag)}, not a string"
    if "\0" in value:
        return "contains NUL, which a shell variable cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid Unicode"
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


_ASSIGNMENT = re.compile(rf'({NAME})="((?:[^"\\]|\\[\\"$`])*)"\n')


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


# --- the same values for systemd's EnvironmentFile= and for `docker run --env-file` ---------------

#: First line of the systemd and docker files; both readers skip a line starting with ``#``.
GENERATED_HEADER = "# Written by tpuboot from the tpu-env metadata attribute; edits are overwritten.\n"


def _noncharacters() -> re.Pattern[str]:
    planes = "".join(f"\\U{plane:04x}fffe\\U{plane:04x}ffff" for plane in range(1, 17))
    return re.compile(f"[\\ud800-\\udfff\\ufdd0-\\ufdef\\ufffe\\uffff{planes}]")


#: What systemd's utf8_is_valid refuses in text that is otherwise UTF-8 (unichar_is_valid in
#: src/basic/utf8.c, 249 to 257): UTF-16 surrogates and the 66 Unicode noncharacters (U+FDD0 to
#: U+FDEF, and the last two code points of each plane, U+nFFFE and U+nFFFF).
SYSTEMD_REFUSED = _noncharacters()


def systemd_problem(key: str, value: str) -> str | None:
    """Why ``KEY="value"`` cannot be a line of a file systemd's env-file reader parses (None: it can).

    That reader (load_env_file in src/basic/env-file.c) checks each key and value with
    utf8_is_valid and, on the first that fails, refuses the **whole file** ("invalid UTF-8"): an
    ``EnvironmentFile=`` unit then fails to start, and a user manager's environment.d generator
    (Debian links /etc/environment there) loses every variable. Everything else a tpu-env value may
    hold is read back byte for byte (:func:`render_systemd_env_file`). The other forms that check
    refuses cannot reach it: invalid or overlong UTF-8 never comes out of a str's encoding, and
    NUL and lone surrogates are refused for every file by :func:`parse_tpu_env`. The reader has no
    line or key length limit (a file up to 64 MiB); keys are shell names, which it takes as such.
    """
    bad = SYSTEMD_REFUSED.search(key) or SYSTEMD_REFUSED.search(value)
    if bad is None:
        return None
    return (
        f"holds U+{ord(bad.group()):04X}, a Unicode noncharacter, and systemd's env-file reader "
        "refuses a whole file holding one"
    )


def render_systemd_env_file(values: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The tpu-env values for systemd's ``EnvironmentFile=`` (``KEY="value"``, one per key), and
    those left out (key → why: :func:`systemd_problem`).

    systemd's reader (parse_env_file_internal in src/basic/env-file.c, the same state machine in
    249 and 257) takes a double-quoted value up to the closing quote, newlines and carriage
    returns included; inside it ``\\`` followed by one of ``"\\`$`` (SHELL_NEED_ESCAPE) gives that
    character, and nothing is expanded. So :func:`shell_quote`'s escaping is read back byte for
    byte. Since 248 (pull request 18129) env_value_is_valid refuses no control character; 239 to
    247 dropped values holding one other than tab and newline, but no supported release has those.
    The reader has no line length limit; the executor drops a single assignment longer than
    ARG_MAX, far above :data:`MAX_ENV_STRING`.
    """
    carried: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for key, value in values.items():
        why = systemd_problem(key, value)
        if why is None:
            carried[key] = value
        else:
            skipped[key] = why
    return GENERATED_HEADER + render_env_file(carried), skipped


#: The longest line (its newline not counted) docker's reader takes: opts/envfile.go in docker/cli
#: scans with bufio.Scanner's default 64 KiB buffer, which must hold the newline too; a longer
#: line fails the whole ``docker run``.
DOCKER_MAX_LINE = 64 * 1024 - 1


_QUOTES = ('"', "'")


def docker_problem(key: str, value: str) -> str | None:
    """Why ``KEY=value`` cannot be a line of a docker env-file (None: it can, byte for byte).

    docker reads one variable a line, with no quoting or escapes: the value is everything after
    the first ``=`` up to the newline, trailing blanks kept. bufio.ScanLines drops one carriage
    return before the newline, and a line must fit the scanner's buffer. Go's utf8.Valid, which
    the reader applies to each line, accepts noncharacters: docker carries what systemd refuses.

    Decision on quotes: a value wrapped in one matching pair (``"x"``, ``'x'``, ``""``) is read
    as written by every docker CLI released so far, but docker/cli pull request 6805 (open)
    would strip that pair, as docker compose does. A file whose meaning depends on the CLI
    version is not written: such a value is left out, and named, rather than be wrong under
    one of them. A quote anywhere else (``a"b``, ``"x``) means the same to both.
    """
    if "\n" in value:
        return "holds a newline, and docker's --env-file reads one line per variable"
    if value.endswith("\r"):
        return "ends in a carriage return, which docker's --env-file drops"
    if len(value) >= 2 and value[0] == value[-1] and value[0] in _QUOTES:
        return (
            "is wrapped in matching quotes, which docker's --env-file keeps today and a later docker "
            "may strip (docker/cli pull request 6805)"
        )
    size = len(key) + 1 + len(value.encode("utf-8"))
    if size > DOCKER_MAX_LINE:
        return f"{size} bytes as KEY=value, over the {DOCKER_MAX_LINE} docker's --env-file reads in a line"
    return None


def render_docker_env_file(values: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The tpu-env values as ``docker run --env-file`` reads them, and those left out (key → why).

    A value docker cannot carry is left out whole, never written as a line docker would read
    differently (a newline would start a new variable, or make docker refuse the file).
    """
    lines = [GENERATED_HEADER]
    skipped: dict[str, str] = {}
    for key, value in values.items():
        why = docker_problem(key, value)
        if why is None:
            lines.append(f"{key}={value}\n")
        else:
            skipped[key] = why
    return "".join(lines), skipped


def env_value(env: Mapping[str, str], key: str) -> str | None:
    """tpu-env's ``KEY``, else ``TPU_KEY`` (the name GKE and VMs made through Compute Engine use);
    an empty value is no value."""
    for name in (key, f"TPU_{key}"):
        value = (env.get(name) or "").strip()
        if value:
            return value
    return None
