"""``/run/tpuboot/notice``: the notices now, for a job that asks without the metadata server.

The daemon writes it atomically (tpuboot/atomicfile.py) whenever a notice key's value changes, and
only then (an unchanged content is not rewritten); `tpuboot wait-maintenance`, `tpuboot status` and
doctor read it. Its format (JSON, doc/notices.md)::

    {"active": true,
     "notices": [{"kind": "preempted", "value": "TRUE", "window_start": null}]}

``notices`` holds the active notices only, the most urgent first; ``window_start`` is RFC 3339 UTC
or null. A job that only asks "is the host going away?" reads ``active``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tpuboot.atomicfile import write_file
from tpuboot.paths import Root
from tpuboot.records import read_record

if TYPE_CHECKING:  # readers (`status`, doctor, wait-maintenance) need not load the parser
    from tpuboot.notices.parse import Notice

NOTICE_PATH = "/run/tpuboot/notice"
#: A larger file is not tpuboot's.
MAX_SIZE = 64 << 10


def render(notices: Iterable[Notice]) -> bytes:
    """The file's content for ``notices`` (the active ones are written)."""
    active = [
        {"kind": n.kind, "value": n.value, "window_start": n.window_text() or None}
        for n in notices
        if n.active
    ]
    return (json.dumps({"active": bool(active), "notices": active}) + "\n").encode()


def save(root: Root, notices: Iterable[Notice]) -> bool:
    """Write the file if its content changed; True if it was rewritten (FileWriteError on failure)."""
    return write_file(root, NOTICE_PATH, render(notices), mode=0o644)


def load(root: Root) -> dict[str, Any] | None:
    """The file's data; None when it is absent (the daemon has not written it: not running, or
    ``notices.enabled`` is false). FileReadError when it cannot be read or is not what tpuboot writes."""
    return read_record(root, NOTICE_PATH, key="notices", what="tpuboot's notice file", limit=MAX_SIZE)


def active(data: dict[str, Any], kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The active notices in ``data``, of ``kinds`` only when given."""
    wanted = None if kinds is None else set(kinds)
    return [n for n in data["notices"] if isinstance(n, dict) and (wanted is None or n.get("kind") in wanted)]


def describe(notice: dict[str, Any]) -> str:
    """One notice of the file as a line: ``preempted TRUE`` or ``upcoming SCHEDULED PENDING at ...``."""
    from tpuboot.errors import printable

    when = notice.get("window_start")
    at = f" (window starts {printable(str(when))})" if when else ""
    return f"{printable(str(notice.get('kind')))} {printable(str(notice.get('value')))}{at}"
