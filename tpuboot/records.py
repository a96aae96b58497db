"""The JSON records the daemon keeps for its commands and doctor to read (the notice file, the
runtime metrics' file): one reading, one message for a file that is not what tpuboot wrote."""

from __future__ import annotations

import json
from typing import Any

from tpuboot.atomicfile import FileReadError, read_file
from tpuboot.paths import Root


def read_record(root: Root, path: str, *, key: str, what: str, limit: int) -> dict[str, Any] | None:
    """The JSON object at ``path``, with a list under ``key``; None when absent. FileReadError
    when it cannot be read or is not ``what`` ("tpuboot's notice file"): the fix is to remove
    it, since the daemon writes it again."""
    data = read_file(root, path, limit=limit)
    if data is None:
        return None
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get(key), list):
        raise FileReadError(f"{path} is not {what}; remove it (the daemon writes it again)")
    return parsed
