"""The kernel command line as the kernel splits it, and as GRUB hands it over: one reading for
``/proc/cmdline`` (the running boot) and for the line update-grub writes (the next boot).

Why a port and not ``str.split()``: Python splits at any Unicode white space, the kernel only at
the bytes its own ``isspace`` knows (lib/ctype.c: tab, newline, vertical tab, form feed, carriage
return, space, and 0xA0, Latin-1's no-break space). A pasted UTF-8 no-break space (C2 A0)
between ``quiet`` and ``idle=poll`` is two bytes, so Python sees two clean words where the kernel
gets ``quiet\\xc2`` and ``idle=poll``, or ``idle=poll\\xc2`` when the space came after it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The bytes lib/ctype.c classes as space (_S): isspace() in lib/cmdline.c's next_arg.
KERNEL_SPACE = frozenset(b"\t\n\v\f\r \xa0")
#: What GRUB's script lexer (grub-core/script/yylex.l) would read as more than plain words on a
#: ``linux`` line: expansion, escapes, single quotes, command separators, a new command.
_GRUB_SPECIAL = frozenset("$\\'`;|&<>{}\n")


class CmdlineUnknown(ValueError):
    """The GRUB variables hold text GRUB's script parser would reinterpret: the kernel line is not
    known without running GRUB."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name (``-`` read as ``_``, as the kernel's parameq does) and its
    value (None for a bare word), each shown with any byte that is not UTF-8 escaped."""

    name: str
    value: str | None


def kernel_params(line: bytes) -> list[Param]:
    """The parameters the kernel parses from ``line``, in order: lib/cmdline.c's ``next_arg`` as
    ``parse_args`` calls it (kernel/params.c), up to ``--`` (what follows is init's)."""
    params: list[Param] = []
    pos = _skip_spaces(line, 0)
    while pos < len(line):
        param, value, pos = _next_arg(line, pos)
        if value is None and param == b"--":
            break
        params.append(Param(_text(param).replace("-", "_"), None if value is None else _text(value)))
    return params


def _skip_spaces(line: bytes, pos: int) -> int:
    while pos < len(line) and line[pos] in KERNEL_SPACE:
        pos += 1
    return pos


def _next_arg(line: bytes, pos: int) -> tuple[bytes, bytes | None, int]:
    """One argument from ``pos``: its name, value and where the next begins (next_arg's rules: a
    ``"`` toggles quoting, space inside quotes is kept, one pair of quotes around the value or the
    whole argument is dropped)."""
    quoted = line[pos : pos + 1] == b'"'
    if quoted:
        pos += 1
    in_quote = quoted
    end = pos
    equals = -1
    while end < len(line):
        char = line[end]
        if char in KERNEL_SPACE and not in_quote:
            break
        if equals < 0 and char == 0x3D:  # '='
            equals = end
        if char == 0x22:  # '"'
            in_quote = not in_quote
        end += 1
    arg = bytearray(line[pos:end])
    if quoted and arg.endswith(b'"'):
        del arg[-1]
    if equals < 0:
        return bytes(arg), None, _skip_spaces(line, end + 1)
    cut = equals - pos
    name, value = bytes(arg[:cut]), bytes(arg[cut + 1 :])
    if value.startswith(b'"'):
        value = value[1:]
        if not quoted and value.endswith(b'"'):
            value = value[:-1]
    return name, value, _skip_spaces(line, end + 1)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def grub_linux_line(linux: str, default: str) -> bytes:
    """The command line GRUB gives the kernel from ``GRUB_CMDLINE_LINUX`` and
    ``GRUB_CMDLINE_LINUX_DEFAULT``: 10_linux writes both, space-separated, onto the ``linux``
    line of grub.cfg; GRUB's script lexer splits that at spaces and tabs outside ``"..."`` and
    drops the quotes; grub_create_loader_cmdline joins the words with spaces, quoting one that
    holds a space. Raises :class:`CmdlineUnknown` for anything else GRUB would interpret."""
    text = f"{linux} {default}"
    special = sorted(_GRUB_SPECIAL.intersection(text))
    if special:
        raise CmdlineUnknown(
            f"the command line holds {''.join(special)!r}, which GRUB's own parser reinterprets"
        )
    words: list[str] = []
    word: list[str] = []
    started = in_quote = False
    for char in text:
        if char in " \t" and not in_quote:
            if started:
                words.append("".join(word))
            word, started = [], False
        elif char == '"':
            in_quote, started = not in_quote, True
        elif char == "#" and not started:
            raise CmdlineUnknown("a word starts with '#', a comment to GRUB's parser")
        elif char == "\t":
            raise CmdlineUnknown("a tab inside quotes")
        else:
            word.append(char)
            started = True
    if in_quote:
        raise CmdlineUnknown('an unterminated "')
    if started:
        words.append("".join(word))
    return " ".join(f'"{w}"' if " " in w else w for w in words).encode("utf-8", "surrogateescape")
