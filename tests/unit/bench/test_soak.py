"""The soak's own parts, without a guest: its document catalog, its file reader, its arithmetic."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.soak import (
    BASE,
    CATALOG,
    FAULTS,
    Served,
    SoakReport,
    error_kind,
    explain_streak,
    longest_life,
    pooled_slope,
    reader_catalog,
)
from bench.soak_reader import Tally, parse
from harness.mds_emulator import HOSTILE_VALUES, Faults, MetadataEmulator
from tests.unit.helpers.metadata import make_client
from tpuboot.env.tpuenv import MAX_TPU_ENV_BYTES, TpuEnvError, parse_tpu_env, render_env_file
from tpuboot.errors import MetadataError


@pytest.mark.parametrize("doc", CATALOG, ids=lambda d: d.label)
def test_each_document_gives_what_the_soak_expects_of_the_file(doc) -> None:
    text = doc.text + "#" * doc.pad
    if doc.expected is None:
        with pytest.raises(TpuEnvError):
            parse_tpu_env(text.encode())
    else:
        assert len(text.encode()) <= MAX_TPU_ENV_BYTES
        assert parse_tpu_env(text.encode()).values == doc.expected


def test_the_catalog_has_good_and_refused_documents_and_every_fault_is_the_emulators() -> None:
    assert sum(d.expected is None for d in CATALOG) >= 5
    assert sum(d.expected is not None for d in CATALOG) >= 5
    for fields in FAULTS.values():
        if fields is not None:
            Faults(**fields)  # a field the emulator does not have raises TypeError


@pytest.mark.parametrize(
    "values",
    [{"A": "1"}, HOSTILE_VALUES, {"B": "x\\\ny", "C": '\\$`"', "D": ""}],
    ids=["plain", "hostile", "escapes"],
)
def test_the_readers_own_parser_reads_what_tpuboot_writes(values: dict[str, str]) -> None:
    assert parse(render_env_file(values)) == values


@pytest.mark.parametrize(
    "text",
    ['A="1"', 'A="1\n', 'A="$(id)"\n', 'A="`id`"\n', 'A="x" B="y"\n', '1A="x"\n', "A=x\n", 'A="x"\nB="'],
    ids=[
        "no newline",
        "no closing quote",
        "expansion",
        "backtick",
        "two on a line",
        "bad name",
        "unquoted",
        "cut",
    ],
)
def test_the_reader_calls_anything_else_garbled(text: str) -> None:
    assert parse(text) is None


def test_no_fault_of_the_soak_turns_a_document_into_another_whole_answer() -> None:
    """Under every fault, tpuboot's client gets each document whole or not at all: what it takes is
    a document the soak served. (A Content-Length of 100000 made a whole answer of the 1 MiB
    document's first 100000 bytes, which parsed: the file then held values no document gave.)"""
    keys = {f"tpu-env-{n}": doc.text + "#" * doc.pad for n, doc in enumerate(CATALOG)}
    faults = {name: fields for name, fields in FAULTS.items() if fields is not None}
    emulators = {name: MetadataEmulator(keys).start() for name in faults}
    try:
        for name, fields in faults.items():
            emulators[name].set_faults(**fields)

        def fetch(job: tuple[str, str]) -> tuple[str, str, bytes | None]:
            name, key = job
            client = make_client(emulators[name], timeout=0.5)
            try:
                return name, key, client.get(f"instance/attributes/{key}", deadline_s=1.0).body
            except MetadataError:
                return name, key, None  # no answer: the file keeps what it held
            finally:
                client.close()

        jobs = [(name, key) for name in faults for key in keys]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(fetch, jobs))
    finally:
        for emulator in emulators.values():
            emulator.close()
    wrong = [(name, key, len(body)) for name, key, body in answers if body not in (None, keys[key].encode())]
    assert not wrong


def test_the_readers_catalog_names_a_refused_documents_parsable_prefix() -> None:
    catalog = reader_catalog()
    good = [entry for entry in catalog if entry["good"]]
    assert good[0]["values"] == BASE
    assert [e["label"] for e in good[1:]] == [d.label for d in CATALOG if d.expected is not None]
    refused = [entry for entry in catalog if not entry["good"]]
    assert [e["label"] for e in refused] == ["larger than 1 MiB (refused whole)"]
    assert refused[0]["values"] == {**BASE, "WORKER_ID": "7"}


def entry(label: str, values: dict[str, str], good: bool = True) -> dict[str, object]:
    return {"label": label, "values": values, "good": good}


def test_the_tally_files_each_read(tmp_path) -> None:
    path = tmp_path / "tpu-env"
    tally = Tally([entry("one", {"A": "1"}), entry("two", {"A": "2"}), entry("bad", {"A": "3"}, good=False)])
    tally.read(str(path))
    path.write_text(render_env_file({"A": "2"}))
    tally.read(str(path))
    path.write_text(render_env_file({"A": "3"}))
    tally.read(str(path))
    path.write_bytes(b'A="\xff"\n')
    tally.read(str(path))
    assert tally.counts == {"reads": 4, "missing": 1, "garbled": 1, "unexpected": 1}
    assert tally.seen == {1: 1}
    assert [s["kind"] for s in tally.samples] == ["missing", "garbled"]


def test_each_run_of_wrong_reads_is_one_streak_named_after_the_nearest_document(tmp_path) -> None:
    path = tmp_path / "tpu-env"
    base = {"A": "1", "B": "2", "C": "3"}
    tally = Tally(
        [entry("base", base), entry("b9", {**base, "B": "9"}), entry("big", {**base, "B": "7"}, False)]
    )
    for values, reads in (
        ({**base, "B": "7"}, 3),
        (base, 1),
        ({"A": "1", "B": "9"}, 2),
        ({**base, "D": "x"}, 1),
    ):
        path.write_text(render_env_file(values))
        for _ in range(reads):
            tally.read(str(path))
    assert tally.counts["unexpected"] == 6
    streaks = [(s["reads"], s["closest"], s["closest_good"], s["differs"]) for s in tally.streaks]
    assert streaks == [(3, "big", False, 0), (2, "b9", True, 1), (1, "base", True, 1)]
    assert tally.streaks[1]["names"] == ["C=None (it gives '3')"]
    assert tally.streaks[0]["first_at_s"] <= tally.streaks[0]["last_at_s"] <= tally.streaks[1]["first_at_s"]


def test_a_streak_is_told_in_the_soaks_time_with_the_documents_served_before_it() -> None:
    nearest = {
        "closest": "larger than 1 MiB (refused whole)",
        "closest_good": False,
        "differs": 0,
        "names": [],
    }
    streak = {"first_at_s": 2230.2, "last_at_s": 2237.0, "reads": 331, **nearest}
    served = [
        Served("sample", 0.0),
        Served("larger than 1 MiB", 2100.0),
        Served("alias", 2200.0),
        Served("worker 3", 2240.0),
    ]
    assert explain_streak(streak, 4.0, served) == (
        "2234-2241 s (331 reads): nearest 'larger than 1 MiB (refused whole)' (the same values); "
        "served last before: 'larger than 1 MiB' at 2100 s, 'alias' at 2200 s"
    )


def test_a_streak_is_placed_among_the_documents_by_the_guests_clock_not_the_soaks_notes() -> None:
    nearest = {
        "closest": "worker 3",
        "closest_good": True,
        "differs": 1,
        "names": ["WORKER_ID='3' (it gives '0')"],
    }
    # The reader's clock started at guest time 500. 'worker 3' was put at guest 2700.0-2700.5 but
    # the soak noted it only at 2203 s (its guest command took its time to return): a streak whose
    # first read is at guest 2700.2 began while that PUT was under way.
    streak = {"first_at_s": 2200.2, "last_at_s": 2201.2, "reads": 51, **nearest}
    served = [
        Served("sample", 0.0),
        Served("alias", 2100.0, 2597.0, 2597.1),
        Served("worker 3", 2203.0, 2700.0, 2700.5),
        Served("sample", 2300.0, 2797.0, 2797.1),
    ]
    told = explain_streak(streak, 1.0, served, reader_clock=500.0)
    # In soak time by the last answered document's clock offset (2100 - 2597.1), not 1 + 2200.2.
    assert told.startswith("2203-2204 s (51 reads): nearest 'worker 3'")
    assert told.endswith("served last before: 'alias' at 2100 s, 'worker 3' at 2203 s (its PUT under way)")
    # Without the guest's clock, by the soak's notes: 'worker 3' looks served after the streak began.
    assert explain_streak(streak, 1.0, served).endswith("'sample' at 0 s, 'alias' at 2100 s")


def test_wrong_reads_are_one_failure_that_lists_each_streak() -> None:
    report = SoakReport(minutes=3, seed=1, reader={"reads": 100, "unexpected": 5}, vbar_running_at_end=True)
    report.unexpected_reads = ["10-11 s (2 reads): nearest 'a'", "20-21 s (3 reads): nearest 'b'"]
    assert report.failures() == [
        "tpu-env held values no document gave in 5 reads:"
        "\n      10-11 s (2 reads): nearest 'a'\n      20-21 s (3 reads): nearest 'b'"
    ]


def test_growth_is_pooled_within_each_process_so_a_restart_is_not_growth() -> None:
    # Two processes, each flat; the second starts lower (a restart): no growth.
    flat = [(1, t, 100.0) for t in (0, 600, 1200)] + [(2, t, 50.0) for t in (1800, 2400, 3000)]
    assert pooled_slope(flat) == (0.0, 6, pytest.approx(2400 / 3600))
    # One fd every 10 minutes in each process: 6 per hour.
    rising = [(1, t, 10 + t / 600) for t in (0, 600, 1200)] + [
        (2, t, 3 + (t - 1800) / 600) for t in (1800, 2400, 3000)
    ]
    assert pooled_slope(rising)[0] == pytest.approx(6.0)
    assert pooled_slope([(1, 0, 1.0), (1, 60, 9.0)]) == (0.0, 0, 0.0)  # too few samples to say


def test_error_kinds_blank_what_varies() -> None:
    a = error_kind("0000:00:04.0: bind failed (errno 16), retrying in 2.5 s: 'x'\ntraceback")
    b = error_kind('0000:01:00.0: bind failed (errno 5), retrying in 10 s: "y"')
    assert a == b == "DBDF: bind failed (errno N), retrying in N s: '…'"


def test_the_longest_lived_process_is_the_one_sampled_longest() -> None:
    samples = [(1, 0.0, 10, 5, 100), (1, 60.0, 11, 5, 110), (2, 70.0, 9, 4, 90), (2, 250.0, 12, 6, 95)]
    life = longest_life(samples)
    assert (life.minutes, life.first, life.last) == (3.0, (9, 4, 90), (12, 6, 95))
    assert longest_life([]).minutes == 0.0


def test_each_long_life_is_sloped_after_its_warm_up_alone() -> None:
    from bench.soak import life_growth

    # pid 1: 40 min; RSS climbs 1000 KiB in its first 5 min (start-up), then 120 KiB an hour; one
    # fd more half-way, no thread. pid 2: too short to slope.
    samples = []
    for t in range(0, 2401, 15):
        rss = 30000 + min(t, 300) * 1000 / 300 + max(0, t - 300) * 120 / 3600
        samples.append((1, float(t), 13 if t >= 1800 else 12, 8, int(rss)))
    samples += [(2, 2500.0, 12, 8, 30000), (2, 2515.0, 12, 8, 30000)]
    lives = life_growth(samples)
    assert [life.pid for life in lives] == [1]
    life = lives[0]
    assert life.minutes == pytest.approx(40.0)
    assert life.rss_kib == pytest.approx(120, abs=2)  # the warm-up is not growth
    assert 0 < life.fds < 3 and life.threads == 0
    assert life.first == (12, 8, 30000) and life.last == (13, 8, 31000 + 70)
    assert life.rss_halves == (pytest.approx(120, abs=2), pytest.approx(120, abs=2))  # a steady pace
    assert life.mappings == {}  # none sampled


def test_a_life_tells_growth_that_levels_off_and_which_mapping_grows() -> None:
    from bench.soak import MAPPINGS, life_growth

    # 65 min: after warm-up the anonymous mappings grow 600 KiB/h for 30 min, then stay; the heap
    # and the rest are flat.
    samples, maps = [], []
    for t in range(0, 3901, 15):
        anon = 10000 + min(max(0, t - 300), 1800) * 600 / 3600
        samples.append((7, float(t), 15, 6, int(20000 + anon)))
        maps.append((7, float(t), 2000, int(anon), 17000, 1000))
    maps.append((8, 100.0, 1, 1, 1, 1))  # another process's
    (life,) = life_growth(samples, maps=maps)
    first_half, second_half = life.rss_halves
    assert first_half == pytest.approx(600, abs=10) and second_half == 0
    assert list(life.mappings) == list(MAPPINGS)
    assert life.mappings["anon"] == (10000, 10300, pytest.approx(life.rss_kib, abs=1))
    assert life.mappings["heap"] == (2000, 2000, 0.0) and life.mappings["file"][2] == 0.0
    assert life.smaps_kib == pytest.approx(life.mappings["anon"][2])


def test_a_lifes_halves_follow_smaps_where_vmrss_stood_still() -> None:
    from bench.soak import life_growth

    # VmRSS reads the same all life (its per-thread counters not flushed); smaps sees 300 KiB/h.
    samples = [(5, float(t), 15, 10, 45220) for t in range(0, 3601, 15)]
    maps = [(5, float(t), 6500, 25000 + t * 300 // 3600, 13876, 72) for t in range(0, 3601, 15)]
    (life,) = life_growth(samples, maps=maps)
    assert life.rss_kib == 0.0
    assert life.smaps_kib == pytest.approx(300, abs=1)
    assert life.rss_halves == (pytest.approx(300, abs=2), pytest.approx(300, abs=2))


def test_the_probe_splits_a_processs_rss_by_mapping() -> None:
    import subprocess

    from bench.soak import MAPPINGS, PROBE

    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        script = PROBE.replace("$(systemctl show -P MainPID tpuboot)", str(sleeper.pid))
        fields = [int(f) for f in subprocess.run(["sh", "-c", script], capture_output=True, check=True,
                                                 text=True).stdout.split()]  # fmt: skip
        rollup = Path(f"/proc/{sleeper.pid}/smaps_rollup").read_text()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(fields) == 4 + len(MAPPINGS) and fields[0] == sleeper.pid
    rss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Rss:"))
    assert sum(fields[4:]) == rss and fields[6] > 0  # a sleep's RSS is mostly its files' pages


def test_the_long_life_mode_refuses_a_life_too_short_to_tell(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.soak import main

    with pytest.raises(SystemExit) as exited:
        main(["--life-minutes", "5"])
    assert exited.value.code == 2
    assert "--life-minutes: 5 is under 30" in capsys.readouterr().err


def test_the_soaks_put_serves_the_document_and_tells_when_by_the_readers_clock() -> None:
    import subprocess
    import sys
    import time

    from bench.soak import PUT

    with MetadataEmulator({"tpu-env": "ZONE: a\n"}) as mds:
        url = f"http://{mds.host}/_emulator/v1/instance/attributes/tpu-env"
        before = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", PUT, url, "3"], input=b"WORKER_ID: '3'\n", capture_output=True, check=True
        )
        after = time.monotonic()
        assert mds.values["instance/attributes/tpu-env"] == "WORKER_ID: '3'\n###"
    sent, answered = (float(f) for f in done.stdout.split())
    assert before <= sent <= answered <= after  # CLOCK_MONOTONIC is the machine's, the reader's too


def test_a_slopes_error_tells_a_steady_leak_from_steps_that_stop() -> None:
    import random

    from bench.soak import slope_error_per_hour, slope_per_hour

    noise = random.Random(7)
    # Flat with noise: the slope is within two errors of zero.
    flat = [(float(t), 40000 + noise.gauss(0, 30)) for t in range(0, 3601, 15)]
    assert abs(slope_per_hour(flat)) <= 2 * slope_error_per_hour(flat)
    # A steady 150 KiB/h under the same noise: far outside them.
    leak = [(t, v + t * 150 / 3600) for t, v in flat]
    assert slope_per_hour(leak) > 2 * slope_error_per_hour(leak) > 0
    # Steps (an arena grows now and then): each residual follows the one before, so the error is
    # wider than residuals as large but alternating in sign (no likeness between neighbours) give.
    steps = [(float(t), 40000.0 + 64 * (t // 900)) for t in range(0, 3601, 15)]
    slope, mt, mv = slope_per_hour(steps) / 3600, 1800.0, sum(v for _, v in steps) / len(steps)
    rms = (sum((v - mv - slope * (t - mt)) ** 2 for t, v in steps) / len(steps)) ** 0.5
    alternating = [(t, mv + slope * (t - mt) + (rms if i % 2 else -rms)) for i, (t, _) in enumerate(steps)]
    assert slope_error_per_hour(steps) > 3 * slope_error_per_hour(alternating) > 0
    assert slope_error_per_hour(flat[:3]) == 0.0  # too few to say
