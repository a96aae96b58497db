"""The soak's own parts, without a guest: its document catalog, its file reader, its arithmetic."""

from __future__ import annotations

import pytest

from bench.soak import CATALOG, FAULTS, error_kind, longest_life, pooled_slope
from bench.soak_reader import Tally, parse
from harness.mds_emulator import HOSTILE_VALUES, Faults
from tpuboot.env.tpuenv import MAX_TPU_ENV_BYTES, TpuEnvError, parse_tpu_env, render_env_file


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


def test_the_tally_files_each_read(tmp_path) -> None:
    path = tmp_path / "tpu-env"
    tally = Tally([{"A": "1"}, {"A": "2"}])
    tally.read(str(path))
    path.write_text(render_env_file({"A": "2"}))
    tally.read(str(path))
    path.write_text(render_env_file({"A": "3"}))
    tally.read(str(path))
    path.write_bytes(b'A="\xff"\n')
    tally.read(str(path))
    assert tally.counts == {"reads": 4, "missing": 1, "garbled": 1, "unexpected": 1}
    assert tally.seen == {1: 1}
    assert [s["kind"] for s in tally.samples] == ["missing", "unexpected", "garbled"]


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


def test_the_long_life_mode_refuses_a_life_too_short_to_tell(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.soak import main

    with pytest.raises(SystemExit) as exited:
        main(["--life-minutes", "5"])
    assert exited.value.code == 2
    assert "--life-minutes: 5 is under 30" in capsys.readouterr().err
