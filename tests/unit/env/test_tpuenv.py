"""tpu-env parsing and rendering: only safe input is accepted, and the shells read back exactly the values."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.mds_emulator import ALIAS_BOMB, HOSTILE_VALUES, INVALID_YAML, SAMPLE_TPU_ENV, tpu_env_yaml
from tpuboot.env.tpuenv import (
    MAX_DEPTH,
    TpuEnvError,
    parse_env_file,
    parse_tpu_env,
    render_env_file,
    shell_quote,
)

SHELLS = [shell for shell in ("dash", "bash") if shutil.which(shell)]


def source_in(shell: str, env_file: Path, keys: list[str]) -> dict[str, str]:
    """What ``set -a; . FILE`` defines in ``shell``, read back through ``env -0`` (exported values)."""
    script = 'set -a; . "$1"; exec env -0'
    run = subprocess.run(
        [shell, "-c", script, shell, str(env_file)],
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        capture_output=True,
        check=True,
        timeout=30,
    )
    assert run.stderr == b""
    seen = dict(entry.split(b"=", 1) for entry in run.stdout.split(b"\0") if b"=" in entry)
    return {key: seen[key.encode()].decode("utf-8") for key in keys if key.encode() in seen}


def test_both_shells_are_present() -> None:
    assert SHELLS == ["dash", "bash"], "install the dash and bash Debian packages"


def test_sample_parses_in_source_order() -> None:
    env = parse_tpu_env(tpu_env_yaml(SAMPLE_TPU_ENV))
    assert env.values == SAMPLE_TPU_ENV
    assert list(env.values) == list(SAMPLE_TPU_ENV)
    assert env.skipped == {}


def test_values_are_the_text_written_not_yaml_typing() -> None:
    """YAML 1.1 would give 16, 83, 90, True, 1.5, None...: the runtime reads strings, so the text stays."""
    text = (
        "INT: 8\nHEX: 0x10\nOCTAL: 0123\nSEXAGESIMAL: 1:30\nUNDERSCORE: 1_000\nFLOAT: 1.50\nEXP: 1e3\n"
        "INF: .inf\nB1: yes\nB2: False\nON: on\nTILDE: ~\nNULL_: null\nBLANK:\nDATE: 2026-11-29\n"
        "TIME: 2026-11-29 10:00:00\nQUOTED: '0x10'\nDQUOTED: \"a\\tb\"\nFOLDED: one\n  two\n"
        "STR_TAG: !!str 0123\nINT_TAG: !!int 0x10\n"
    )
    assert parse_tpu_env(text).values == {
        "INT": "8",
        "HEX": "0x10",
        "OCTAL": "0123",
        "SEXAGESIMAL": "1:30",
        "UNDERSCORE": "1_000",
        "FLOAT": "1.50",
        "EXP": "1e3",
        "INF": ".inf",
        "B1": "yes",
        "B2": "False",
        "ON": "on",
        "TILDE": "~",
        "NULL_": "null",
        "BLANK": "",
        "DATE": "2026-11-29",
        "TIME": "2026-11-29 10:00:00",
        "QUOTED": "0x10",
        "DQUOTED": "a\tb",
        "FOLDED": "one two",
        "STR_TAG": "0123",
        "INT_TAG": "0x10",
    }


def test_quoted_values_read_as_the_documented_script_read_them() -> None:
    """The documented script printed str() of safe_load's values: for quoted values (all a real
    tpu-env holds) both read the same text."""
    values = {**SAMPLE_TPU_ENV, **HOSTILE_VALUES}
    text = tpu_env_yaml(values) + "SINGLE: 'it''s 0123'\n"
    documented = {key: str(value) for key, value in yaml.safe_load(text).items()}
    assert parse_tpu_env(text).values == documented


def test_bad_keys_and_values_are_skipped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = (
        "GOOD: ok\n1BAD: x\nwith-dash: x\n'has space': x\n42: x\nPATH: /evil\nLD_PRELOAD: /evil.so\n"
        'NESTED: {a: 1}\nLIST: [1, 2]\nNUL: "a\\0b"\nBIN: !!binary aGk=\n'
    )
    with caplog.at_level(logging.WARNING, logger="tpuboot.env.tpuenv"):
        env = parse_tpu_env(text)
    assert env.values == {"GOOD": "ok"}
    assert set(env.skipped) == {
        "'1BAD'",
        "'with-dash'",
        "'has space'",
        "'42'",
        "PATH",
        "LD_PRELOAD",
        "NESTED",
        "LIST",
        "NUL",
        "BIN",
    }
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "skipped 10 of 11 keys" in message
    for key in env.skipped:
        assert key in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("- a\n- b\n", "is a list, not a mapping"),
        ("just text\n", "is a single value, not a mapping"),
        ("", "is empty"),
        (INVALID_YAML, "not valid YAML .line"),
        (ALIAS_BOMB, "anchors or aliases"),
        ("A: &x hello\nB: *x\n", "anchors or aliases"),
        ("A: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", "nests deeper"),
        ("---\nA: 1\n---\nB: 2\n", "not valid YAML"),
    ],
)
def test_unusable_values_are_refused(text: str, problem: str) -> None:
    with pytest.raises(TpuEnvError, match=problem):
        parse_tpu_env(text)


def test_size_is_bounded_before_parsing() -> None:
    with pytest.raises(TpuEnvError, match="larger than 100 bytes"):
        parse_tpu_env("A: " + "x" * 100, max_bytes=100)
    with pytest.raises(TpuEnvError, match="larger than 100 bytes"):
        parse_tpu_env(b"A: " + b"x" * 100, max_bytes=100)


def test_non_utf8_bytes_are_refused() -> None:
    with pytest.raises(TpuEnvError, match="not UTF-8"):
        parse_tpu_env(b"A: \xff\n")


def test_render_writes_one_double_quoted_assignment_per_key() -> None:
    assert (
        render_env_file({"A": "1", "EMPTY": "", "URL": "gcr.io/x:1"}) == 'A="1"\nEMPTY=""\nURL="gcr.io/x:1"\n'
    )
    assert shell_quote('a"$`\\b') == '"a\\"\\$\\`\\\\b"'


def test_nul_cannot_be_quoted() -> None:
    with pytest.raises(ValueError, match="NUL"):
        shell_quote("a\0b")


@pytest.mark.parametrize("shell", SHELLS)
def test_hostile_values_read_back_exactly(shell: str, tmp_path: Path) -> None:
    env_file = tmp_path / "tpu-env"
    env_file.write_text(render_env_file(HOSTILE_VALUES), encoding="utf-8")
    assert source_in(shell, env_file, list(HOSTILE_VALUES)) == HOSTILE_VALUES
    assert not Path("/tmp/tpuboot-pwned").exists()


SPECIALS = [*"\"'$`\\\n\r\t !#&()*;<>?[]{}|~=%^", "$(", "${", "\\\n", "'\"", "\u00a0", "\u2028", "\ufeff"]
ANY_CHARS = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0"), max_size=4)
VALUES = st.lists(st.one_of(st.sampled_from(SPECIALS), ANY_CHARS), max_size=10).map("".join)
KEYS = st.from_regex(r"K_[A-Za-z0-9_]{0,6}", fullmatch=True)


def _round_trip(values: Mapping[str, str], tmp_path: Path) -> None:
    env_file = tmp_path / "tpu-env"
    env_file.write_text(render_env_file(values), encoding="utf-8")
    for shell in SHELLS:
        assert source_in(shell, env_file, list(values)) == dict(values), shell


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(KEYS, VALUES, min_size=1, max_size=6))
def test_property_any_value_survives_sourcing_in_dash_and_bash(
    values: dict[str, str], tmp_path: Path
) -> None:
    _round_trip(values, tmp_path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(KEYS, VALUES, min_size=1, max_size=4))
def test_property_yaml_attribute_to_shell_is_lossless(values: dict[str, str], tmp_path: Path) -> None:
    """The whole path: YAML as the metadata server holds it → parse → render → source."""
    env = parse_tpu_env(tpu_env_yaml(values))
    assert env.values == values
    _round_trip(env.values, tmp_path)


@settings(deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True),
        st.text(st.characters(blacklist_characters="\0"), max_size=40),
        max_size=6,
    )
)
def test_parse_env_file_reads_back_what_render_env_file_wrote(values: dict[str, str]) -> None:
    assert parse_env_file(render_env_file(values)) == values


def test_parse_env_file_refuses_a_file_tpuboot_did_not_write() -> None:
    assert parse_env_file('A="1"\nexport B=2\n') is None
