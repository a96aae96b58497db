"""The daemon's tpu-env part (tpuboot/env/service.py) tells its listeners of each result: the CDI
spec's refresh from boot on, and the containers from when they are made, after READY."""

from __future__ import annotations

import logging

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.env.results import SyncResult
from tpuboot.env.service import EnvService
from tpuboot.env.sync import EnvSync
from tpuboot.paths import Root

WRITTEN = SyncResult("metadata", 14, "e1", "tpu-env: 14 keys from metadata")


def test_a_listener_added_later_hears_the_results_from_then_on_and_a_bug_in_one_stops_no_other(
    emulator: MetadataEmulator, root: Root, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[str] = []

    def broken() -> None:
        heard.append("broken")
        raise RuntimeError("a bug in a listener")

    service = EnvService(EnvSync(root, make_config(emulator), make_client(emulator)), 1.0, False, broken)
    with caplog.at_level(logging.ERROR, logger="tpuboot.env.service"):
        service.result(WRITTEN)  # the boot's result: the containers do not exist yet
        service.listen(lambda: heard.append("later"))
        service.result(WRITTEN)  # a watch's
    assert heard == ["broken", "broken", "later"]
    assert [r.getMessage() for r in caplog.records] == [
        "tpu-env: acting on a change failed unexpectedly; please report it"
    ] * 2
    assert service.status().detail == "tpu-env: 14 keys from metadata"
