"""The kernel command line the next boot gets: what update-grub will write into grub.cfg from
/etc/default/grub and /etc/default/grub.d/*.cfg (GRUB_CMDLINE_LINUX, then
GRUB_CMDLINE_LINUX_DEFAULT, on every normal entry's ``linux`` line).

grub-mkconfig *sources* those files as shell. tpuboot does not: the files may belong to an image
tree (``--root``) that is not this machine's, and running its shell on the build host, as root,
would hand the host to whoever made the image. So this module reads the forms those files use
in practice and refuses the rest, naming the file and line:

- comments, blank lines, ``NAME=value`` and ``export NAME=value`` (several per line too), where
  the value is made of unquoted text, ``'single-quoted'`` and ``"double-quoted"`` parts with
  ``$NAME`` / ``${NAME}`` expanded (a variable never set is empty, as in sh) and ``\\`` escapes;
- an assignment whose value is anything else (```lsb_release -i -s```, ``$(...)``) makes that
  variable unknown: harmless until a command-line variable uses it, an error then;
- tpuboot's own drop-in (``tpuboot_cmdline_add PARAM``: append PARAM to GRUB_CMDLINE_LINUX
  unless either variable sets it; the x86_64 ``case`` adding intel_iommu), read by its known
  text; an edited copy is read too, as long as its lines keep those forms;
- anything else (a command, ``if``, ``.``, ``eval``, a function) is refused: :class:`Unreadable`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from tpuboot.atomicfile import read_file
from tpuboot.errors import TpubootError
from tpuboot.paths import Root

GRUB_DEFAULT = "/etc/default/grub"
GRUB_DROPIN_DIR = "/etc/default/grub.d"
TPUBOOT_DROPIN = "/etc/default/grub.d/tpuboot.cfg"
CMDLINE_VARS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")
MAX_BYTES = 1 << 20

# tpuboot's drop-in (conf/grub.d/tpuboot.cfg): the function and the architecture test, by their
# text. A unit test keeps these in step with the shipped file.
TPUBOOT_FUNCTION = """tpuboot_cmdline_add() {
\tcase " $GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT " in
\t*" ${1%%=*}="*) ;;
\t*) GRUB_CMDLINE_LINUX="${GRUB_CMDLINE_LINUX:+$GRUB_CMDLINE_LINUX }$1" ;;
\tesac
}
"""
TPUBOOT_ARCH_CASE = re.compile(
    r'^case "\$\(dpkg --print-architecture 2>/dev/null \|\| uname -m\)" in\n'
    r"amd64 \| x86_64\) (?P<calls>[^\n]*) ;;\n"
    r"esac\n",
    re.M,
)
TPUBOOT_UNSET = "unset -f tpuboot_cmdline_add"
_CALL = re.compile(r"tpuboot_cmdline_add ([A-Za-z0-9_.,=:/+-]+)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
X86 = ("x86_64", "amd64")


class Unreadable(TpubootError):
    """A GRUB default file uses shell that tpuboot does not evaluate."""


@dataclass(frozen=True)
class NextBoot:
    """The two variables as update-grub will see them, and the files read in order."""

    linux: str
    default: str
    files: tuple[str, ...]

    @property
    def words(self) -> list[str]:
        """The parameters in the order grub.cfg gives them (LINUX, then DEFAULT)."""
        return f"{self.linux} {self.default}".split()

    def params(self) -> list[tuple[str, str | None]]:
        pairs: list[tuple[str, str | None]] = []
        for word in self.words:
            name, eq, value = word.partition("=")
            pairs.append((name, value.replace('"', "") if eq else None))
        return pairs


class _Unknown:
    """A variable whose value tpuboot cannot know without running shell; ``why`` says where."""

    def __init__(self, why: str) -> None:
        self.why = why


class _Reader:
    """One file's statements, applied to ``env``."""

    def __init__(self, env: dict[str, str | _Unknown], path: str, text: str, arch: str) -> None:
        self.env = env
        self.path = path
        self.text = text
        self.arch = arch
        self.pos = 0
        self.line = 1
        self.start_line = 1  # of the statement being read: what an error names

    def fail(self, what: str) -> Unreadable:
        return Unreadable(
            f"{self.path} line {self.start_line}: {what}; tpuboot reads only NAME=value assignments there "
            "(it never runs the file): make it one, or put the parameters in GRUB_CMDLINE_LINUX"
        )

    # ------------------------------------------------------------------ lexing

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _take(self) -> str:
        char = self._peek()
        self.pos += 1
        if char == "\n":
            self.line += 1
        return char

    def _skip_blanks(self) -> None:
        while self._peek() in (" ", "\t") and self._peek():
            self._take()
        if self._peek() == "\\" and self.text[self.pos + 1 : self.pos + 2] == "\n":
            self._take()
            self._take()
            self._skip_blanks()

    def _expand(self) -> str | _Unknown:
        """After a ``$``: ``NAME`` or ``{NAME}``; anything else is refused."""
        if self._peek() == "{":
            end = self.text.find("}", self.pos)
            name = self.text[self.pos + 1 : end] if end > 0 else ""
            if not _NAME.fullmatch(name):
                raise self.fail(f"${{{name or '...'}}} is more than a plain variable")
            self.pos = end + 1
        else:
            match = _NAME.match(self.text, self.pos)
            if not match:
                raise self.fail("a $ that is not $NAME or ${NAME}")
            name = match.group()
            self.pos = match.end()
        return self.env.get(name, "")  # an assignment splits nothing, quoted or not

    def _word(self) -> str | _Unknown | None:
        """One shell word made of the supported parts; None at an end of statement."""
        parts: list[str] = []
        unknown: _Unknown | None = None
        start = self.pos
        while True:
            char = self._peek()
            if char in ("", "\n", ";", " ", "\t", "#") and not (char == "#" and self.pos > start):
                break
            if char in "`|&<>()":
                unknown = unknown or _Unknown(f"{self.path} line {self.line}")
                self._skip_command_text(char)
                continue
            self._take()
            if char == "'":
                end = self.text.find("'", self.pos)
                if end < 0:
                    raise self.fail("an unterminated '")
                parts.append(self.text[self.pos : end])
                self.line += self.text.count("\n", self.pos, end)
                self.pos = end + 1
            elif char == '"':
                while True:
                    inner = self._take()
                    if inner == "":
                        raise self.fail('an unterminated "')
                    if inner == '"':
                        break
                    if inner == "\\" and self._peek() in ('"', "\\", "$", "`", "\n"):
                        escaped = self._take()
                        parts.append("" if escaped == "\n" else escaped)
                    elif inner == "$":
                        found = self._dollar(parts)
                        unknown = unknown or found
                    elif inner == "`":
                        unknown = unknown or _Unknown(f"{self.path} line {self.line}")
                        end = self.text.find("`", self.pos)
                        if end < 0:
                            raise self.fail("an unterminated `")
                        self.pos = end + 1
                    else:
                        parts.append(inner)
            elif char == "\\":
                escaped = self._take()
                parts.append("" if escaped == "\n" else escaped)
            elif char == "$":
                found = self._dollar(parts)
                unknown = unknown or found
            else:
                parts.append(char)
        if self.pos == start:
            return None
        return unknown if unknown is not None else "".join(parts)

    def _dollar(self, parts: list[str]) -> _Unknown | None:
        """After a ``$``, quoted or not: a parameter's value joins ``parts``; a command
        substitution, or a parameter whose value is unknown, makes the word unknown."""
        if self._peek() == "(":
            unknown = _Unknown(f"{self.path} line {self.line}")
            self._skip_command_text("$")
            return unknown
        value = self._expand()
        if isinstance(value, _Unknown):
            return value
        parts.append(value)
        return None

    def _skip_command_text(self, opener: str) -> None:
        """Past a command substitution (`...` or $(...)) whose output tpuboot will not know; any
        other operator is not an assignment at all."""
        if opener == "`":
            end = self.text.find("`", self.pos + 1)
        elif opener == "$":
            end = self.text.find(")", self.pos)
        else:
            raise self.fail(f"{opener!r} outside quotes (a command, not an assignment)")
        if end < 0:
            raise self.fail("an unterminated command substitution")
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end + 1

    def _end_of_statement(self) -> None:
        self._skip_blanks()
        char = self._peek()
        if char == "#":
            end = self.text.find("\n", self.pos)
            self.pos = len(self.text) if end < 0 else end
            char = self._peek()
        if char in ("\n", ";"):
            self._take()
        elif char:
            raise self.fail("more than assignments on one line")

    # ------------------------------------------------------------------ statements

    def run(self) -> None:
        while self.pos < len(self.text):
            self._skip_blanks()
            char = self._peek()
            if char in ("\n", ";"):
                self._take()
                continue
            if char == "#":
                self._end_of_statement()
                continue
            if not char:
                break
            self._statement()

    def _statement(self) -> None:
        self.start_line = self.line
        rest = self.text[self.pos :]
        if rest.startswith("export ") or rest.startswith("export\t"):
            self.pos += len("export")
            self._skip_blanks()
            rest = self.text[self.pos :]
        call = _CALL.match(rest)
        if call and (call.end() == len(rest) or rest[call.end()] in " \t\n;#"):
            self._tpuboot_add(call.group(1))
            self.pos += call.end()
            self._end_of_statement()
            return
        match = _NAME.match(rest)
        if not match or rest[match.end() : match.end() + 1] != "=":
            word = rest.split(None, 1)[0] if rest.strip() else rest
            raise self.fail(f"{word[:40]!r} is a command, not an assignment")
        while True:
            match = _NAME.match(self.text, self.pos)
            if not match or self.text[match.end() : match.end() + 1] != "=":
                break
            self.pos = match.end() + 1
            value = self._word()
            self.env[match.group()] = "" if value is None else value
            self._skip_blanks()
        self._end_of_statement()

    def _tpuboot_add(self, param: str) -> None:
        if "tpuboot_cmdline_add" not in self.env:
            raise self.fail("tpuboot_cmdline_add without its definition (tpuboot's drop-in, edited)")
        values = [self.env.get(name, "") for name in CMDLINE_VARS]
        for value in values:
            if isinstance(value, _Unknown):
                raise self.fail(
                    f"tpuboot_cmdline_add {param} after a value tpuboot cannot know ({value.why})"
                )
        name = param.split("=", 1)[0]
        if f" {name}=" in f" {values[0]} {values[1]} ":
            return
        linux = values[0]
        assert isinstance(linux, str)
        self.env["GRUB_CMDLINE_LINUX"] = f"{linux} {param}" if linux else param


def _prepare_tpuboot_dropin(text: str, arch: str) -> tuple[str, bool]:
    """The drop-in's text with its known function, arch ``case`` and ``unset`` reduced to plain
    calls; True when the function was defined there."""
    defined = TPUBOOT_FUNCTION in text
    text = text.replace(TPUBOOT_FUNCTION, "\n" * TPUBOOT_FUNCTION.count("\n"))

    def case(match: re.Match[str]) -> str:
        calls = match.group("calls") if arch in X86 else ""
        return f"{calls}\n\n\n"

    text = TPUBOOT_ARCH_CASE.sub(case, text)
    text = re.sub(rf"^{re.escape(TPUBOOT_UNSET)}[ \t]*$", "", text, flags=re.M)
    return text, defined


def grub_files(root: Root) -> Iterator[str]:
    """The files grub-mkconfig sources, in its order: /etc/default/grub, then grub.d/*.cfg by name
    (byte order, as the shell's glob in the C locale)."""
    if root.path(GRUB_DEFAULT).is_file():
        yield GRUB_DEFAULT
    folder = root.path(GRUB_DROPIN_DIR)
    if folder.is_dir():
        for entry in sorted(folder.iterdir(), key=lambda p: p.name.encode()):
            if entry.name.endswith(".cfg") and entry.is_file():
                yield f"{GRUB_DROPIN_DIR}/{entry.name}"


def next_boot(root: Root, arch: str) -> NextBoot | None:
    """The command line update-grub will generate, or None when there is no GRUB configuration.

    ``arch``: the image's architecture (``uname -m`` or dpkg's name), for tpuboot's drop-in.
    Raises :class:`Unreadable` with the file and line when a file is not plain assignments.
    """
    files = list(grub_files(root))
    if not files:
        return None
    env: dict[str, str | _Unknown] = {}
    for path in files:
        data = read_file(root, path, limit=MAX_BYTES)
        if data is None:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise Unreadable(f"{path}: not UTF-8 text; fix or remove it") from None
        if "tpuboot_cmdline_add" in text:
            text, defined = _prepare_tpuboot_dropin(text, arch)
            if defined:
                env["tpuboot_cmdline_add"] = ""
        _Reader(env, path, text, arch).run()
        env.pop("tpuboot_cmdline_add", None)
    values = []
    for name in CMDLINE_VARS:
        value = env.get(name, "")
        if isinstance(value, _Unknown):
            raise Unreadable(
                f"{name} is set from a command's output ({value.why}), which tpuboot does not run: "
                "write the parameters there literally"
            )
        values.append(value)
    return NextBoot(values[0], values[1], tuple(files))
