"""``/run/tpuboot/runtime``: libtpu's fault gauges as the daemon last read them, for doctor,
NPD and `tpuboot status`, which never call a job's libtpu themselves.

The daemon writes it atomically when what it holds changes (a fault on or off, a port polled or
no longer, one failing or answering again), never per poll; it is removed when no chip is held.
Its format (JSON, doc/runtime-metrics.md)::

    {"hang": false, "slice_error": null,
     "ports": [{"port": 8431, "pid": 1234, "holder": "unit job.service", "hang": false,
                "slice_error": null, "error": null}]}
"""

from __future__ import annotations

import json
from typing import Any

from tpuboot.atomicfile import remove_file, write_file
from tpuboot.paths import Root
from tpuboot.records import read_record

RUNTIME_PATH = "/run/tpuboot/runtime"
MAX_SIZE = 256 << 10


def save(root: Root, ports: list[dict[str, Any]]) -> bool:
    """Write the file for ``ports`` (the polled ports' faults and holders); True if rewritten."""
    hang = any(p.get("hang") for p in ports)
    errors = [p["slice_error"] for p in ports if p.get("slice_error") is not None]
    data = {"hang": hang, "slice_error": errors[0] if errors else None, "ports": ports}
    return write_file(root, RUNTIME_PATH, (json.dumps(data) + "\n").encode(), mode=0o644)


def clear(root: Root) -> bool:
    """No chip held: no file (doctor then says nothing is polled)."""
    return remove_file(root, RUNTIME_PATH)


def load(root: Root) -> dict[str, Any] | None:
    """The file's data; None when absent. FileReadError when it is not what tpuboot writes."""
    return read_record(root, RUNTIME_PATH, key="ports", what="tpuboot's runtime file", limit=MAX_SIZE)
