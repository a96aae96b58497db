"""bench.memgrowth's own measures of a process's memory, on real processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bench.memgrowth import mallinfo, pymalloc, smaps_by_kind
from bench.soak import MAPPINGS, PROBE


def test_the_bench_splits_rss_by_mapping_as_the_soaks_probe_does() -> None:
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        script = PROBE.replace("$(systemctl show -P MainPID tpuboot)", str(sleeper.pid))
        probed = subprocess.run(
            ["sh", "-c", script], capture_output=True, check=True, text=True
        ).stdout.split()
        split = smaps_by_kind(Path(f"/proc/{sleeper.pid}/smaps").read_text())
    finally:
        sleeper.kill()
        sleeper.wait()
    assert split == {f"rss_{kind}_kib": int(kib) for kind, kib in zip(MAPPINGS, probed[4:], strict=True)}


def test_the_allocators_layers_are_read() -> None:
    held = [bytes(1000) for _ in range(2000)]  # 2 MB through malloc (over pymalloc's 512 B)
    layers = mallinfo() | pymalloc()
    assert layers["malloc_in_use"] >= 2_000_000 and layers["malloc_free"] >= 0
    assert layers["pymalloc_arenas"] >= 1 and layers["pymalloc_allocated"] > 0
    assert set(layers) == {"malloc_in_use", "malloc_free", "malloc_mmapped"} | {
        "pymalloc_arenas",
        "pymalloc_allocated",
        "pymalloc_available",
    }
    del held


class Kept:
    """An object a leak keeps."""


class Keeper:
    def __init__(self) -> None:
        self.kept = Kept()


def test_who_holds_the_objects_born_since_a_moment_is_named() -> None:
    import collections
    import gc

    from bench.memgrowth import holders

    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    keepers = [Keeper() for _ in range(30)]
    held = holders(before, collections.Counter({"Kept": 30, "Keeper": 30}), sample=10)
    assert held["Kept"] == {f"{__name__}.Keeper": 10}  # through each Keeper's __dict__
    assert held["Keeper"] == {"builtins.list": 10}
    del keepers


def test_the_bench_builds_and_runs_the_daemon_it_measures() -> None:
    """A few seconds of the bench end to end: it builds the daemon through wiring's seams, so a
    renamed seam fails here, not in the next hour-long measurement."""
    from bench.memgrowth import run

    result = run(minutes=0.05, warmup=0.5, pace=0.05, seed=1, trace=False)
    assert sum(result["moves"].values()) > 0
    assert result["memory_marks"] == ["after warm-up", "half-way", "at the end", "after malloc_trim(0)"]


def test_the_growth_of_pymallocs_blocks_is_named_by_site_and_large_blocks_are_left_out() -> None:
    import tracemalloc

    from bench.memgrowth import small_block_growth

    tracemalloc.start(4)
    try:
        before = tracemalloc.take_snapshot()
        small = [f"kept string {n}" for n in range(1000)]  # the site this test names
        large = [bytes(100_000) for _ in range(20)]  # malloc's, not pymalloc's
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    top = small_block_growth(before, after, 3)[0]
    size, blocks = int(top.split()[0]), int(top.split()[2])
    assert "tests/unit/bench/test_memgrowth.py:" in top and 1000 <= blocks < 1100
    assert size < 1_000_000  # none of the 2 MB of large blocks
    del small, large
