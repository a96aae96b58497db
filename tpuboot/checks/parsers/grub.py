"""The kernel command line the next boot gets: what update-grub will write into grub.cfg from
/etc/default/grub and /etc/default/grub.d/*.cfg (GRUB_CMDLINE_LINUX, then
GRUB_CMDLINE_LINUX_DEFAULT, on every normal entry's ``linux`` line).

grub-mkconfig *sources* those files as shell. tpuboot does not: the files may belong to an image
tree (``--root``) that is not this machine's, and running its shell on the build host, as root,
would hand the host to whoever made the image. So this module reads the forms those files use
in practice and refuses the rest, naming the file and line:

- comments, blank lines, ``NAME=value`` and ``export NAME=value`` (several per line too), where
  the value is made of unquoted text, ``'single-quoted'`` and ``"double-quoted"`` parts with
  ``$NAME`` / ``${NAME}`` expanded and ``\\`` escapes; ``#`` is a comment only where a word
  would start (``A=x#y`` is ``x#y``, as in sh). A ``GRUB_*`` variable never set is empty;
- an assignment whose value is anything else (```lsb_release -i -s```, ``$(...)``, ``~``, a
  variable these files never set, which update-grub's environment may) makes that variable
  unknown: harmless until a command-line variable uses it, an error then;
- tpuboot's own drop-in (``tpuboot_cmdline_add PARAM``: append PARAM to GRUB_CMDLINE_LINUX
  unless either variable sets it; the x86_64 ``case`` adding intel_iommu), read by its known
  text; an edited copy is read too, as long as its lines keep those forms;
- anything else (a command, ``if``, ``.``, ``eval``, a function, ``${X:-y}``, a syntax error)
  is refused: :class:`Unreadable`, which the checks turn into "cannot tell", never a PASS.

The two variables are then read as GRUB and the kernel read them (:mod:`tpuboot.checks.parsers.cmdline`):
a no-break space is not a separator to either.
"""

from __future__ import annotations

import bisect
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from tpuboot.atomicfile import read_file
from tpuboot.checks.parsers.cmdline import CmdlineUnknown, Param, grub_linux_line, kernel_params
from tpuboot.env.assignment import NAME, NAME_RE
from tpuboot.errors import TpubootError
from tpuboot.kernel_params import X86
from tpuboot.paths import Root

GRUB_DEFAULT = "/etc/default/grub"
GRUB_DROPIN_DIR = "/etc/default/grub.d"
TPUBOOT_DROPIN = f"{GRUB_DROPIN_DIR}/tpuboot.cfg"
CMDLINE_VARS = ("GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT")

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


class Unreadable(TpubootError):
    """A GRUB default file uses shell that tpuboot does not evaluate."""


@dataclass(frozen=True)
class NextBoot:
    """The two variables as update-grub will see them, and the files read in order."""

    linux: str
    default: str
    files: tuple[str, ...]

    def params(self) -> list[Param]:
        """The parameters the kernel will parse, in the order grub.cfg gives them (LINUX, then
        DEFAULT); :class:`Unreadable` when GRUB's own parser would read the line differently."""
        try:
            return kernel_params(grub_linux_line(self.linux, self.default))
        except CmdlineUnknown as exc:
            raise Unreadable(f"{' '.join(CMDLINE_VARS)}: {exc}; write the parameters there plainly") from None

    @property
    def words(self) -> list[str]:
        """Each parameter as NAME=value or NAME."""
        return [p.name if p.value is None else f"{p.name}={p.value}" for p in self.params()]


class _Unknown:
    """A variable whose value tpuboot cannot know without running shell; ``why`` says where."""

    def __init__(self, why: str) -> None:
        self.why = why


# Unquoted text that means nothing more to sh inside a word (``#`` is literal there: it starts a
# comment only where a word would start), text inside double quotes, the blanks between words
# (a backslash-newline is removed before sh reads a line), and the body of a command
# substitution tpuboot can skip without misreading where it ends.
_PLAIN = re.compile(r"[^ \t\n;'\"\\$`|&<>()~]+")
_DQ_PLAIN = re.compile(r'[^"\\$`]+')
_BLANKS = re.compile(r"(?:[ \t]|\\\n)*")
_NAME_EQ = re.compile(f"({NAME})=")
_EXPORT = re.compile(r"export(?:[ \t]|\\\n)+")
_SUBST_BODY = re.compile(r"[^'\"\\$`()\n]*")
_COMMAND = re.compile(r"[^ \t\n;]{1,40}")
_NAME_GOES_ON = re.compile(r"(?:\\\n)+[A-Za-z0-9_]")


class _Reader:
    """One file's statements, applied to ``env``: a single left-to-right pass (each character is
    looked at a bounded number of times, so a file costs time linear in its size)."""

    def __init__(self, env: dict[str, str | _Unknown], path: str, text: str) -> None:
        self.env = env
        self.path = path
        self.text = text
        self.pos = 0
        self.start = 0  # of the statement being read: what an error names
        self._newlines = [m.start() for m in re.finditer("\n", text)]

    def line(self, pos: int) -> int:
        return bisect.bisect_left(self._newlines, pos) + 1

    def fail(self, what: str) -> Unreadable:
        return Unreadable(
            f"{self.path} line {self.line(self.start)}: {what}; tpuboot reads only NAME=value assignments "
            "there (it never runs the file): make it one, or put the parameters in GRUB_CMDLINE_LINUX"
        )

    def unknown(self) -> _Unknown:
        return _Unknown(f"{self.path} line {self.line(self.pos)}")

    def _peek(self, ahead: int = 0) -> str:
        return self.text[self.pos + ahead : self.pos + ahead + 1]

    def _blanks(self) -> None:
        self.pos = _BLANKS.match(self.text, self.pos).end()  # type: ignore[union-attr]  # * always matches

    def _comment(self) -> None:
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end < 0 else end

    # ------------------------------------------------------------------ statements

    def run(self) -> None:
        while True:
            self._blanks()
            char = self._peek()
            if not char:
                return
            if char == "\n":
                self.pos += 1
            elif char == "#":
                self._comment()
            else:
                self._statement()

    def _statement(self) -> None:
        self.start = self.pos
        export = _EXPORT.match(self.text, self.pos)
        if export:
            self.pos = export.end()
        call = _CALL.match(self.text, self.pos)
        if call and self.text[call.end() : call.end() + 1] in ("", " ", "\t", "\n", ";", "#"):
            self.pos = call.end()
            self._tpuboot_add(call.group(1))
        else:
            # Plain assignments take effect one by one; export's are its arguments, all expanded
            # before it runs (``export A=1 B=$A`` gives B the old A).
            pending: list[tuple[str, str | _Unknown]] = []
            while (match := _NAME_EQ.match(self.text, self.pos)) is not None:
                self.pos = match.end()
                pending.append((match.group(1), self._word()))
                if not export:
                    self.env.update(pending[-1:])
                self._blanks()
            self.env.update(pending)
            if not pending:
                shown = _COMMAND.match(self.text, self.pos)
                raise self.fail(
                    f"{shown.group() if shown else self._peek()!r} is a command, not an assignment"
                )
        self._end_of_statement()

    def _end_of_statement(self) -> None:
        self._blanks()
        char = self._peek()
        if char == "#":
            self._comment()
        elif char == "\n":
            self.pos += 1
        elif char == ";":
            self.pos += 1
            self._blanks()
            if self._peek() == ";":
                raise self.fail("';' with no command before it (a syntax error to sh)")
        elif char:
            raise self.fail("more than assignments on one line")

    # ------------------------------------------------------------------ words

    def _word(self) -> str | _Unknown:
        """One assignment's value: the supported parts, up to an unquoted blank, newline or ``;``."""
        parts: list[str] = []
        unknown: _Unknown | None = None
        text = self.text
        while self.pos < len(text):
            plain = _PLAIN.match(text, self.pos)
            if plain:
                parts.append(plain.group())
                self.pos = plain.end()
                continue
            char = text[self.pos]
            if char in " \t\n;":
                break
            if char == "\\":
                escaped = self._peek(1)
                if not escaped:
                    raise self.fail("a \\ at the end of the file")
                self.pos += 2
                if escaped != "\n":
                    parts.append(escaped)
            elif char == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.fail("an unterminated '")
                parts.append(text[self.pos + 1 : end])
                self.pos = end + 1
            elif char == '"':
                unknown = self._double(parts) or unknown
            elif char == "$":
                unknown = self._dollar(parts) or unknown
            elif char == "`":
                unknown = self._backquote() or unknown
            elif char == "~":  # a tilde prefix is a home directory
                unknown = unknown or self.unknown()
                self.pos += 1
            else:
                raise self.fail(f"{char!r} outside quotes (a command, not an assignment)")
        return unknown if unknown is not None else "".join(parts)

    def _double(self, parts: list[str]) -> _Unknown | None:
        """A ``"..."`` part: ``\\`` escapes only ``"\\$``, backquote and newline; ``$`` expands."""
        unknown: _Unknown | None = None
        text = self.text
        self.pos += 1
        while True:
            plain = _DQ_PLAIN.match(text, self.pos)
            if plain:
                parts.append(plain.group())
                self.pos = plain.end()
            char = self._peek()
            if not char:
                raise self.fail('an unterminated "')
            if char == '"':
                self.pos += 1
                return unknown
            if char == "\\":
                escaped = self._peek(1)
                if escaped in ('"', "\\", "$", "`"):
                    parts.append(escaped)
                    self.pos += 2
                elif escaped == "\n":
                    self.pos += 2
                else:
                    parts.append("\\")
                    self.pos += 1
            elif char == "$":
                unknown = self._dollar(parts) or unknown
            else:
                unknown = self._backquote() or unknown

    def _dollar(self, parts: list[str]) -> _Unknown | None:
        """``$NAME``, ``${NAME}``: the value joins ``parts``; ``$(...)`` or a value tpuboot cannot
        know makes the word unknown; any other expansion is refused."""
        text = self.text
        after = self._peek(1)
        if after == "(":
            if self._peek(2) == "(":
                raise self.fail("arithmetic expansion $((...))")
            return self._substitution(self.pos + 2, ")")
        if after == "{":
            end = text.find("}", self.pos + 2)
            name = text[self.pos + 2 : end] if end > 0 else ""
            if not NAME_RE.fullmatch(name):
                raise self.fail(f"${{{name[:40] or '...'}}} is more than a plain variable")
            self.pos = end + 1
        else:
            match = NAME_RE.match(text, self.pos + 1)
            if not match:
                raise self.fail("a $ that is not $NAME or ${NAME}")
            name = match.group()
            self.pos = match.end()
            if _NAME_GOES_ON.match(text, self.pos):  # sh joins the lines first: a longer name
                raise self.fail(f"${name} goes on after a backslash-newline")
        value = self.env.get(name)
        if value is None:
            if not name.startswith("GRUB_"):  # update-grub's environment, or the shell's own
                return _Unknown(f"{self.path} line {self.line(self.pos)}: ${name} is not set in these files")
            value = ""  # grub-mkconfig's own names: unset until a file sets them
        if isinstance(value, _Unknown):
            return value
        parts.append(value)
        return None

    def _backquote(self) -> _Unknown:
        return self._substitution(self.pos + 1, "`")

    def _substitution(self, body: int, closer: str) -> _Unknown:
        """Past a command substitution whose output tpuboot will not know. Its body may hold no
        quote, escape, expansion or parenthesis, so where it ends is certain."""
        unknown = self.unknown()
        end = _SUBST_BODY.match(self.text, body).end()  # type: ignore[union-attr]  # * always matches
        if self.text[end : end + 1] != closer:
            raise self.fail("a command substitution that tpuboot cannot read past")
        self.pos = end + 1
        return unknown

    # ------------------------------------------------------------------ tpuboot's drop-in

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
    """The files grub-mkconfig sources, in its order: /etc/default/grub if it is a regular file
    (``test -f``), then every ``grub.d/*.cfg`` that exists (``[ -e ]``): the glob skips names that
    start with a dot and sorts by bytes (dash's glob ignores the locale). dash sources a directory
    as nothing; a fifo or device would block it or worse: :class:`Unreadable`."""
    if root.path(GRUB_DEFAULT).is_file():
        yield GRUB_DEFAULT
    folder = root.path(GRUB_DROPIN_DIR)
    if not folder.is_dir():
        return
    for name in sorted(os.listdir(folder), key=os.fsencode):
        if name.startswith(".") or not name.endswith(".cfg"):
            continue
        path = f"{GRUB_DROPIN_DIR}/{name}"
        try:
            mode = root.path(path).stat().st_mode
        except FileNotFoundError:
            continue  # a dangling link: [ -e ] is false
        except OSError as exc:
            raise Unreadable(f"{shown(path)}: {exc.strerror}; fix or remove it") from None
        if stat.S_ISDIR(mode):
            continue  # dash sources a directory as nothing
        if not stat.S_ISREG(mode):
            raise Unreadable(f"{shown(path)} is not a regular file: update-grub would wait on it; remove it")
        yield path


def shown(path: str) -> str:
    """``path`` printable: a byte of a file name that is not UTF-8 as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def next_boot(root: Root, arch: str) -> NextBoot | None:
    """The command line update-grub will generate, or None when there is no GRUB configuration.

    ``arch``: the image's architecture (``uname -m`` or dpkg's name), for tpuboot's drop-in.
    Raises :class:`Unreadable` with the file and line when a file is not plain assignments (and
    :meth:`NextBoot.params` when GRUB would reinterpret the values).
    """
    files = list(grub_files(root))
    if not files:
        return None
    env: dict[str, str | _Unknown] = {}
    for path in files:
        data = read_file(root, path)
        if data is None:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise Unreadable(f"{shown(path)}: not UTF-8 text; fix or remove it") from None
        if "tpuboot_cmdline_add" in text:
            text, defined = _prepare_tpuboot_dropin(text, arch)
            if defined:
                env["tpuboot_cmdline_add"] = ""
        _Reader(env, shown(path), text).run()
        env.pop("tpuboot_cmdline_add", None)
    values = []
    for name in CMDLINE_VARS:
        value = env.get(name, "")
        if isinstance(value, _Unknown):
            raise Unreadable(
                f"{name} is not known without running shell ({value.why}): a command's output, a home "
                "directory or update-grub's environment; write the parameters there literally"
            )
        values.append(value)
    return NextBoot(values[0], values[1], tuple(files))
