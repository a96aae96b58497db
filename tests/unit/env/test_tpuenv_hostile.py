"""tpu-env documents that PyYAML cannot build, names the shells or the loader read, and values the
kernel cannot pass on: each yields usable values or a one-line refusal, never a traceback."""

from __future__ import annotations

import gzip
import logging
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuboot.env.tpuenv import (
    MAX_ENV_STRING,
    MAX_ENV_TOTAL,
    REFUSED_NAMES,
    TpuEnvError,
    parse_tpu_env,
    render_env_file,
)

# --- item 1: documents that parse but cannot be built -----------------------------------------

#: Each makes yaml.safe_load, or str() of what it built, raise something other than YAMLError
#: (PyYAML 5.4.1 and 6.x; the 4300-digit limit is Python's, from 3.10.7 and 3.11).
UNBUILDABLE = {
    "month 13": ("A: 2026-13-01\n", {"A": "2026-13-01"}),
    "February 30": ("A: 2026-02-30\n", {"A": "2026-02-30"}),
    "year 0": ("A: 0000-01-01\n", {"A": "0000-01-01"}),
    "hour 25": ("A: 2026-01-01 25:00:00\n", {"A": "2026-01-01 25:00:00"}),
    "offset +99:00": ("A: 2026-01-01 00:00:00 +99:00\n", {"A": "2026-01-01 00:00:00 +99:00"}),
    "!!timestamp not a time": ("A: !!timestamp x\n", {"A": "x"}),
    "!!int not a number": ("A: !!int abc\n", {"A": "abc"}),
    "!!int empty": ("A: !!int ''\n", {"A": ""}),
    "!!int _": ("A: !!int _\n", {"A": "_"}),
    "!!int 0x": ("A: !!int 0x\n", {"A": "0x"}),
    "!!int 09": ("A: !!int 09\n", {"A": "09"}),
    "!!float empty": ("A: !!float ''\n", {"A": ""}),
    "!!float .": ("A: !!float .\n", {"A": "."}),
    "!!bool maybe": ("A: !!bool maybe\n", {"A": "maybe"}),
    "5000-digit int": ("A: " + "9" * 5000 + "\n", {"A": "9" * 5000}),
    "sexagesimal past 4300 digits": ("A: " + ":".join(["59"] * 3000) + "\n", {"A": ":".join(["59"] * 3000)}),
}

#: Built by safe_load, but not a string: skipped by name, the rest kept.
NOT_STRINGS = {
    "!!binary": "A: !!binary aGk=\n",
    "!!set": "A: !!set {a, b}\n",
    "local tag": "A: !vendor x\n",
    "!!python/name": "A: !!python/name:os.system ''\n",
    "!!python/object/apply": "A: !!python/object/apply:os.system ['true']\n",
    "!!omap": "A: !!omap [{a: 1}]\n",
    "!!str on a mapping": "A: !!str {a: 1}\n",
}


@pytest.mark.parametrize("name", list(UNBUILDABLE))
def test_documents_pyyaml_cannot_build_yield_the_text_written(name: str) -> None:
    text, values = UNBUILDABLE[name]
    with pytest.raises(Exception) as raised:  # the class of the issue, on this PyYAML
        [str(value) for value in yaml.safe_load(text).values()]
    assert not isinstance(raised.value, yaml.YAMLError)
    assert parse_tpu_env(text + "GOOD: ok\n").values == {**values, "GOOD": "ok"}


@pytest.mark.parametrize("name", list(NOT_STRINGS))
def test_values_tagged_as_other_types_are_skipped_by_name(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tpuboot.env.tpuenv"):
        env = parse_tpu_env(NOT_STRINGS[name] + "GOOD: ok\n")
    assert env.values == {"GOOD": "ok"}
    assert list(env.skipped) == ["A"]
    assert "skipped 1 of 2 keys: A (" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("--- !!set {A, B}\n", "is tagged !!set, not a mapping"),
        ("--- !vendor {A: 1}\n", "is tagged !vendor, not a mapping"),
        ("!!omap [{A: 1}]\n", "is a list, not a mapping"),
        ("A: !<%FF> x\n", "not valid YAML"),
        ("<<: 5\n", None),  # a merge key is not a name: skipped, not merged
        ("<<: {A: 1}\n", None),
    ],
)
def test_top_level_oddities_are_one_line_refusals_or_skips(text: str, problem: str | None) -> None:
    if problem is None:
        assert parse_tpu_env(text + "GOOD: ok\n").values == {"GOOD": "ok"}
    else:
        with pytest.raises(TpuEnvError, match=problem) as raised:
            parse_tpu_env(text)
        assert "\n" not in str(raised.value)


def test_keys_are_text_too_and_the_last_duplicate_wins() -> None:
    env = parse_tpu_env("yes: 1\n~: 2\nA: first\nB: x\nA: [last]\n? [K]\n: v\n!!binary QUJD: x\n")
    assert env.values == {"yes": "1", "B": "x"}
    assert env.skipped == {
        "'~'": "not a shell variable name",
        "A": "a list, not a scalar",
        "<a list key, line 6>": "not a shell variable name",
        "'QUJD'": "not a shell variable name",
    }


SCALARS = st.one_of(
    st.sampled_from(
        ["2026-02-30", "0000-01-01", "1:30", "0123", "0x", ".", "~", "''", '""', "-", ":", "yes", "9" * 4400]
    ),
    st.text(st.sampled_from("0123456789-:._+eExT Zab'\"!%<>"), max_size=12),
)
TAGS = st.sampled_from(
    [
        "",
        "!!int ",
        "!!float ",
        "!!bool ",
        "!!timestamp ",
        "!!null ",
        "!!str ",
        "!!binary ",
        "!!set ",
        "!x ",
        "! ",
    ]
)
LINES = st.tuples(st.sampled_from(["A", "B", "<<", "? ", "- "]), TAGS, SCALARS).map(
    lambda t: f"{t[0]}: {t[1]}{t[2]}" if t[0] not in ("? ", "- ") else f"{t[0]}{t[1]}{t[2]}"
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINES, min_size=1, max_size=4).map("\n".join))
def test_property_any_document_gives_values_or_a_one_line_refusal(text: str) -> None:
    try:
        env = parse_tpu_env(text)
    except TpuEnvError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(isinstance(value, str) for value in env.values.values())


# --- item 6: names the shells or the loader read ----------------------------------------------


def man_names(page: str, pattern: str, section: tuple[str, str] | None = None) -> set[str]:
    """Names a man page installed here defines (skips the test where the page is not installed)."""
    path = Path(f"/usr/share/man/{page}.gz")
    if not path.exists():
        pytest.skip(f"{path} is not installed; install manpages/bash/dash docs")
    text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
    if section is not None:
        start = text.index(section[0])
        text = text[start : text.index(section[1], start)]
    return set(re.findall(pattern, text, flags=re.M))


def kept(names: set[str]) -> list[str]:
    """Which of ``names`` parse_tpu_env would write (and REFUSED_NAMES would not list)."""
    env = parse_tpu_env("".join(f"{name}: x\n" for name in sorted(names)))
    return sorted(set(env.values) | (names - set(REFUSED_NAMES)))


def test_every_shell_variable_the_bash_manual_lists_is_refused() -> None:
    listed = man_names(
        "man1/bash.1", r"^\.TP\n\.B ([A-Za-z_][A-Za-z0-9_]*)$", (".SS Shell Variables", ".SS Arrays")
    )
    assert len(listed) > 100
    assert kept(listed) == []


def test_every_variable_the_dash_manual_names_is_refused() -> None:
    listed = man_names("man1/dash.1", r"\bEv ([A-Z_][A-Z0-9_]*)")
    assert len(listed) > 15
    assert kept(listed) == []


def test_every_loader_variable_ld_so_documents_is_refused() -> None:
    listed = man_names(
        "man8/ld.so.8", r"^\.BR? ((?:LD|MALLOC)_[A-Z0-9_]*|[A-Z]+_PATH|[A-Z_]*DIR|[A-Z_]*CONF)\b"
    )
    secure = man_names(
        "man8/ld.so.8", r"^\.BR ([A-Z_]+) ?,?$", ("Other environment variables", "secure-execution mode if")
    )
    assert "LD_PRELOAD" in listed and "GCONV_PATH" in secure
    assert kept(listed | secure) == []


@pytest.mark.parametrize("name", sorted(REFUSED_NAMES))
def test_each_refused_name_is_skipped_with_its_source(name: str) -> None:
    env = parse_tpu_env(f"{name}: x\nGOOD: ok\n")
    assert env.values == {"GOOD": "ok"}
    assert env.skipped == {name: f"reserved: {REFUSED_NAMES[name]}"}


ORDINARY = [
    "BASHFUL", "BASH_PROFILE_DIR", "LD_RUN_PATH", "LDFLAGS", "LC_PAPER", "LC_TPU", "HISTORY", "HISTORY_DAYS",
    "COMP_NAME", "READLINE_STYLE", "PATHS", "HOMEDIR", "TERMINAL", "ENVIRONMENT", "MALLOC_IMPL", "TPU_PATH",
    "PS5", "IFS_X", "LIBTPU_INIT_ARGS",
]  # fmt: skip


def test_names_that_only_look_like_reserved_ones_are_kept() -> None:
    """No prefix rule: the old one dropped these, losing data."""
    values = {name: "v" for name in ORDINARY}
    assert parse_tpu_env("".join(f"{name}: v\n" for name in ORDINARY)).values == values


def test_an_exported_function_name_is_not_a_variable_name() -> None:
    env = parse_tpu_env("'BASH_FUNC_ls%%': '() { echo pwned; }'\nGOOD: ok\n")
    assert env.values == {"GOOD": "ok"}
    assert env.skipped == {"'BASH_FUNC_ls%%'": "not a shell variable name"}


# --- item 6: what the kernel can pass to a command --------------------------------------------


def run_after_sourcing(shell: str, env_file: Path) -> subprocess.CompletedProcess[bytes]:
    """``set -a; . FILE`` then an external command, as the runtime's start script does."""
    return subprocess.run(
        [shell, "-c", 'set -a; . "$1"; exec /usr/bin/env', shell, str(env_file)],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        timeout=30,
    )


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_a_value_over_the_kernel_limit_is_skipped_and_commands_still_run(
    shell: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    biggest = "x" * (MAX_ENV_STRING - len("FITS=") - 1)  # NAME=value and its NUL: exactly the limit
    text = f"BEFORE: a\nHUGE: '{'y' * (128 * 1024)}'\nFITS: '{biggest}'\nAFTER: b\n"
    with caplog.at_level(logging.WARNING, logger="tpuboot.env.tpuenv"):
        env = parse_tpu_env(text)
    assert list(env.values) == ["BEFORE", "FITS", "AFTER"]
    assert list(env.skipped) == ["HUGE"]
    message = caplog.records[0].getMessage()
    assert "HUGE (131077 bytes as NAME=value, over the kernel's limit of 131071)" in message
    env_file = tmp_path / "tpu-env"
    env_file.write_text(render_env_file(env.values))
    run = run_after_sourcing(shell, env_file)
    assert run.returncode == 0, run.stderr
    assert f"FITS={biggest}\n".encode() in run.stdout


def test_a_value_one_byte_over_fails_every_command_which_is_why_it_is_skipped(tmp_path: Path) -> None:
    env_file = tmp_path / "tpu-env"
    env_file.write_text(render_env_file({"OVER": "x" * (MAX_ENV_STRING - len("OVER="))}))
    run = run_after_sourcing("dash", env_file)
    assert run.returncode != 0 and b"Argument list too long" in run.stderr
    assert parse_tpu_env(f"OVER: '{'x' * (MAX_ENV_STRING - len('OVER='))}'\n").values == {}


def test_multibyte_values_are_measured_in_bytes() -> None:
    value = "é" * (MAX_ENV_STRING // 2)  # half as many characters as bytes
    assert list(parse_tpu_env(f"A: '{value}'\n").skipped) == ["A"]


def test_the_whole_file_is_bounded_in_source_order(tmp_path: Path) -> None:
    chunk = "z" * (100 * 1024)
    text = "".join(f"K{i}: '{chunk}'\n" for i in range(8)) + "SMALL: s\n"
    env = parse_tpu_env(text, max_bytes=2 << 20)
    assert list(env.values) == ["K0", "K1", "K2", "K3", "K4", "SMALL"]  # 5 x 100 KiB fit in 512 KiB
    assert set(env.skipped) == {"K5", "K6", "K7"}
    assert all(
        why == f"past the {MAX_ENV_TOTAL // 1024} KiB bound on the whole tpu-env"
        for why in env.skipped.values()
    )
    size = sum(len(key) + len(value) + 2 + 8 for key, value in env.values.items())
    assert size <= MAX_ENV_TOTAL
    env_file = tmp_path / "tpu-env"
    env_file.write_text(render_env_file(env.values))
    assert run_after_sourcing("bash", env_file).returncode == 0


def test_many_tiny_keys_are_bounded_too() -> None:
    """Each variable costs execve a pointer as well: 1 MiB of ``a: ''`` lines would not fit.
    40 000 keys are 20% past what fits (about 33 500 at 16 bytes each)."""
    text = "".join(f"K{i}: ''\n" for i in range(40_000))
    env = parse_tpu_env(text, max_bytes=2 << 20)
    assert 0 < len(env.values) < 40_000
    assert sum(len(key) + 2 + 8 for key in env.values) <= MAX_ENV_TOTAL
