"""How the configuration file's values are read: a parser per kind of field, and the section base.

A section is a frozen dataclass (tpuboot/config.py has them all) whose fields each name their
default and their parser (:func:`option`); :func:`parse_section` builds one from a YAML mapping,
refusing unknown keys. A parser turns the YAML value into the typed value or raises ConfigError
naming the key and the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from tpuboot.errors import ConfigError, shown

Parser = Callable[[Any, str], Any]

#: The default of an option the file must give.
REQUIRED: Any = dataclasses.MISSING


def fail(where: str, problem: str) -> ConfigError:
    return ConfigError(f"{where}: {problem}")


def key_of(where: str, key: object) -> str:
    """``file: a.b`` for key b under a, so messages name both the file and the key."""
    return f"{where}.{key}" if ": " in where else f"{where}: {key}"


def parse_hex_id(value: Any, where: str) -> int:
    """A 16-bit PCI id: YAML int (0x1ae0) or string ('0x1ae0' / '1ae0')."""
    if isinstance(value, bool):
        raise fail(where, "expected a 16-bit PCI id such as 0x1ae0")
    if isinstance(value, str):
        text = value.lower().removeprefix("0x")
        if not text or any(c not in "0123456789abcdef" for c in text):
            raise fail(where, f"{shown(value)} is not a hex PCI id; write it like 0x1ae0")
        value = int(text, 16)
    if not isinstance(value, int) or not 0 <= value <= 0xFFFF:
        raise fail(where, f"{shown(value)} is not a 16-bit PCI id; write it like 0x1ae0")
    return value


def parse_mode(value: Any, where: str) -> int:
    """A file mode, best written quoted ('0666'); YAML's own octal 0666 is accepted too."""
    if isinstance(value, str) and value and all(c in "01234567" for c in value):
        value = int(value, 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        # Also refuses set-id and sticky bits (0o7000): they mean nothing on a device node.
        raise fail(
            where,
            f"{shown(value)} is not a file mode from 0000 to 0777; write it quoted in octal, like '0666'",
        )
    return value


def parse_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise fail(where, f"{value!r} is not true or false")
    return value


def parse_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise fail(where, f"{value!r} is not a string; quote it")
    return value


def parse_optional_str(value: Any, where: str) -> str | None:
    return None if value is None else parse_str(value, where)


def parse_abs_path(value: Any, where: str) -> str:
    text = parse_str(value, where)
    if not text.startswith("/"):
        raise fail(where, f"{text!r} is not an absolute path")
    return text


def parse_optional_abs_path(value: Any, where: str) -> str | None:
    return None if value is None else parse_abs_path(value, where)


def parse_seconds(most: float, why: str = "") -> Parser:
    """A duration above 0 and at most ``most`` seconds; ``why`` says where the limit comes from.

    NaN fails every comparison and .inf is above any limit, so neither gets through to a timer,
    a socket or a deadline, where each fails later and far from the file (OverflowError, a wait
    that never ends, a deadline always passed).
    """

    def parse(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(where, f"{shown(value)} is not a number of seconds; write it like 5.0")
        if not 0 < value <= most:  # before float(): an int of 400 digits would overflow it
            raise fail(
                where, f"{shown(value)} is out of range; give seconds above 0 and at most {most:g}{why}"
            )
        return float(value)

    return parse


def parse_whole(least: int, most: int, why: str = "") -> Parser:
    """A whole number from ``least`` to ``most``; ``why`` says where the limits come from."""

    def parse(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise fail(where, f"{shown(value)} is not a whole number from {least} to {most}{why}")
        return value

    return parse


def parse_choice(*choices: str) -> Parser:
    def parse(value: Any, where: str) -> str:
        # YAML 1.1 reads bare yes/no/on/off as booleans; map them back.
        if value is True:
            value = "true"
        elif value is False:
            value = "false"
        if value not in choices:
            raise fail(where, f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    return parse


def parse_str_list(
    value: Any, where: str, check: Callable[[str], object], expected: str, *, empty: bool = True
) -> tuple[str, ...]:
    """A list of strings, each given to ``check``, whose ValueError is that item's problem;
    ``expected`` is the problem of a value that is not a list (or, unless ``empty``, an empty one)."""
    if not isinstance(value, list) or not (value or empty):
        raise fail(where, expected)
    for index, item in enumerate(value):
        try:
            check(parse_str(item, f"{where}[{index}]"))
        except ValueError as exc:
            raise fail(f"{where}[{index}]", str(exc)) from None
    return tuple(value)


def parse_str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise fail(where, "expected a mapping of NAME: 'value'")
    out: dict[str, str] = {}
    for key, item in value.items():
        out[parse_str(key, where)] = parse_str(item, key_of(where, key))
    return out


@dataclasses.dataclass(frozen=True)
class Option:
    """A section field's default (REQUIRED: the file must give it) and its parser."""

    default: Any
    parse: Parser


def option(default: Any, parse: Parser) -> Any:
    """A section's dataclass field with its default (or REQUIRED) and its parser; a mutable
    default is copied for each record, so no two share it."""
    metadata = {"option": Option(default, parse)}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


S = TypeVar("S", bound="Section")


class Section:
    """The base of the config's sections, each a frozen dataclass of :func:`option` fields.

    ``options`` maps each field's name to its Option, in the file's order; it is read from the
    class body's fields when the class is made, before ``@dataclass`` replaces them by defaults.
    """

    options: ClassVar[dict[str, Option]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {
            name: value.metadata["option"]
            for name, value in vars(cls).items()
            if isinstance(value, dataclasses.Field) and "option" in value.metadata
        }
        cls.options = {**cls.options, **own}

    def check(self, where: str) -> None:
        """Refuse combinations of values that each parse (a section overrides this)."""

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def parse_section(cls: type[S], data: Any, where: str) -> S:
    """Build section ``cls`` from a YAML mapping, refusing unknown keys."""
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise fail(where, f"expected a mapping, got {type(data).__name__}")
    values = {}
    for key, value in data.items():
        if key not in cls.options:
            known = ", ".join(sorted(cls.options))
            raise fail(where, f"unknown key {key!r} (known keys: {known})")
        values[key] = cls.options[key].parse(value, key_of(where, key))
    required = [name for name, option in cls.options.items() if option.default is REQUIRED]
    if not values.keys() >= set(required):
        raise fail(where, f"{' and '.join(required)} {'are' if len(required) > 1 else 'is'} required")
    section = cls(**values)
    section.check(where)
    return section


def section_parser(cls: type[S]) -> Parser:
    """The parser of a field that is itself a section (``vfio:`` and the others)."""
    return lambda value, where: parse_section(cls, value, where)
