"""The slice bench's parts on a real network stack (bench/slice_sweep.py): its 64 peers answer, its
nftables rule drops exactly one peer's three ports, and each way of sweeping runs in worker 0's
namespace. Short connect timeouts; no time is asserted (the bench prints the figures)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import slice_sweep
from tests.unit.slice.slicenet import AVAILABLE, WHY_NOT, SliceNet

pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.fixture
def net(tmp_path: Path) -> Iterator[SliceNet]:
    slicenet = slice_sweep.peer_slice(tmp_path)
    try:
        yield slicenet
    finally:
        slicenet.close()


def test_one_peer_dropped_is_three_dropped_paths_and_the_rest_refused(net: SliceNet) -> None:
    net.run(1, ["nft", "-f", "-"], input=slice_sweep.drop_rule([slice_sweep.peer_address(5)]))
    result = slice_sweep.in_worker(net, "parallel", 0.3)
    assert result["states"] == {"open": 0, "refused": 189, "dropped": 3, "unreachable": 0, "error": 0}
    for kind in ("python", "bash"):
        assert float(slice_sweep.in_worker(net, kind, 0.3)["seconds"]) > 0  # type: ignore[arg-type]


def test_the_lines_give_the_ratios() -> None:
    data = {
        "connect_timeout": 2.0,
        "sweeps": {"parallel": [2.0, 2.1, 2.0], "python": [6.0, 6.1, 6.0], "bash": [8.0, 8.0, 8.2]},
        "all_dropped_timeout": 0.25,
        "all_dropped": {"parallel": 0.25, "python": 48.0},
        "interval": 1.0,
        "waits": [1.2, 1.1],
    }
    text = "\n".join(slice_sweep.lines(data))
    assert "parallel sweep 2.00 s (1.00 connect timeouts)" in text
    assert "serial, Python 6.00 s: parallel / serial 0.33x" in text
    assert "serial, bash </dev/tcp loop 8.00 s: parallel / serial 0.25x" in text
    assert "1.20 s (1.20), 1.10 s (1.10) (in intervals)" in text
