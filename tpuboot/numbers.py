"""Numbers read from text that another party wrote: the kernel (/proc, sysfs), a server, a file
of tpuboot's own that a crash or a person may have damaged.

Each is ASCII digits only, of bounded length: ``str.isdigit`` and ``int`` accept ``²``,
Arabic-Indic digits, ``+``, spaces and ``_``, none of which the kernel or a server writes in a
number, and ``str.isdigit`` accepts some (``²``) that ``int`` then refuses with a ValueError.
``float`` is as lenient, and more (``nan``, ``inf``, ``1e400``). So every such number is matched
against the kernel's own format first, and only then converted; whatever does not match is None,
which each reader treats as "not known", never as an error that ends a command.
"""

from __future__ import annotations

import math
import re

_DIGITS = re.compile(r"[0-9]{1,20}")
_SIGNED = re.compile(r"-?[0-9]{1,20}")
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_DECIMAL = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?")


def _ascii(text: str | bytes | None) -> str | None:
    if isinstance(text, bytes):
        try:
            return text.decode("ascii")
        except UnicodeDecodeError:
            return None
    return text


def ascii_int(text: str | bytes | None) -> int | None:
    """``text`` as a non-negative integer if it is 1 to 20 ASCII digits, else None."""
    text = _ascii(text)
    if text is None or not _DIGITS.fullmatch(text):
        return None
    return int(text)


def ascii_signed(text: str | bytes | None) -> int | None:
    """:func:`ascii_int` with an optional leading ``-`` (an exit code, a PAM ``-1``), else None."""
    text = _ascii(text)
    if text is None or not _SIGNED.fullmatch(text):
        return None
    return int(text)


def ascii_hex(text: str | bytes | None) -> int | None:
    """``text`` as a non-negative integer if it is 1 to 16 ASCII hex digits, as ``uevent``'s
    ``PCI_ID`` and /proc/locks write them (no ``0x``, sign, space or ``_``: ``int(text, 16)``
    takes all of those), else None."""
    text = _ascii(text)
    if text is None or not _HEX.fullmatch(text):
        return None
    return int(text, 16)


def ascii_decimal(text: str | bytes | None) -> float | None:
    """A non-negative decimal such as a link speed's ``8.0`` or ``2.5``: ASCII digits with at most
    one point, finite; else None (``float`` would take ``nan``, ``inf`` and ``1e400``)."""
    text = _ascii(text)
    if text is None or not _DECIMAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None
