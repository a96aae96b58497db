"""Numbers read from text that another party wrote: the kernel (/proc, sysfs), a server, a file
of tpuboot's own that a crash or a person may have damaged.

Each is ASCII digits only, of bounded length: ``str.isdigit`` and ``int`` accept ``²``,
Arabic-Indic digits, ``+``, spaces and ``_``, none of which the kernel or a server writes in a
number, and ``str.isdigit`` accepts some (``²``) that ``int`` then refuses with a ValueError.
"""

from __future__ import annotations

import re

_DIGITS = re.compile(r"[0-9]{1,20}")


def ascii_int(text: str | bytes | None) -> int | None:
    """``text`` as a non-negative integer if it is 1 to 20 ASCII digits, else None."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            return None
    if text is None or not _DIGITS.fullmatch(text):
        return None
    return int(text)


_HEX = re.compile(r"[0-9a-fA-F]{1,16}")


def ascii_hex(text: str | None) -> int | None:
    """``text`` as a non-negative integer if it is 1 to 16 ASCII hex digits (no ``0x``, sign, space
    or ``_``: ``int(text, 16)`` takes all of those), else None."""
    if text is None or not _HEX.fullmatch(text):
        return None
    return int(text, 16)
