"""What Python 3.10 does differently and the static check cannot see, on the paths tpuboot takes.

Python 3.10's ``datetime.fromisoformat`` reads back only what ``isoformat()`` writes (3.11 reads
most of ISO 8601, ``Z`` included), so the tpu-env cache's timestamp must be in that form for the
offline boot's status line (and `tpuboot doctor`) to show its age on Ubuntu 22.04.
"""

from __future__ import annotations

import json
import re

from harness.mds_emulator import MetadataEmulator
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.env.sync import EnvSync
from tpuboot.paths import Root

CACHE = "/var/lib/tpuboot/tpu-env.json"
# Python 3.10's fromisoformat: YYYY-MM-DD[*HH[:MM[:SS[.fff[fff]]]][+HH:MM[:SS[.ffffff]]]]
PY310_ISOFORMAT = re.compile(
    r"\d{4}-\d{2}-\d{2}(.\d{2}(:\d{2}(:\d{2}(\.\d{3}(\d{3})?)?)?)?([+-]\d{2}:\d{2}(:\d{2}(\.\d{6})?)?)?)?\Z"
)


def test_the_cache_timestamp_is_one_python_3_10_reads_back(root: Root, emulator: MetadataEmulator) -> None:
    client = make_client(emulator, timeout=0.3)
    try:
        assert EnvSync(root, make_config(emulator), client).sync_once(deadline_s=5).source == "metadata"
        fetched = json.loads(root.path(CACHE).read_text())["fetched"]
        assert PY310_ISOFORMAT.match(fetched.replace("Z", "+00:00")), fetched
        emulator.stop()  # offline: the status line shows the cache's time, parsed, not echoed
        status = EnvSync(root, make_config(emulator), client).sync_once(deadline_s=1).status
    finally:
        client.close()
    minute = fetched[:16]
    assert status.endswith(f" from cache of {minute}Z"), status


def test_the_pattern_is_python_3_10_s() -> None:
    for accepted in ("2026-11-29", "2026-11-29T20:00", "2026-11-29T20:00:30.123456+00:00"):
        assert PY310_ISOFORMAT.match(accepted), accepted
    for refused in ("2026-11-29T20:00:30Z", "2026-11-29T20:00:30.12+00:00", "20261129T200030"):
        assert not PY310_ISOFORMAT.match(refused), refused
