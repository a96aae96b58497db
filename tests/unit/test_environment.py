"""/etc/environment: our keys set once each, in place; every other byte kept; no rewrite when unchanged."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpuboot.config import DEFAULT_ENVIRONMENT
from tpuboot.environment import ensure_environment, format_assignment, merge_environment
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

PATH = "/etc/environment"


def test_missing_file_gets_every_key_in_config_order(root: Root) -> None:
    written = ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    lines = root.path(PATH).read_text().splitlines()
    assert lines == [f"{key}={value}" for key, value in DEFAULT_ENVIRONMENT.items()]
    assert list(written.values()) == lines  # the lines written, by key, as the purge record needs


def test_values_are_quoted_only_when_needed() -> None:
    assert format_assignment("A", "/usr/bin/python3") == "A=/usr/bin/python3"
    assert format_assignment("A", "a b") == 'A="a b"'
    assert format_assignment("A", "") == 'A=""'
    assert format_assignment("A", "it's #1") == 'A="it\'s #1"'


@pytest.mark.parametrize("value", ['say "hi"', "a\\b", "$HOME", "`id`", "two\nlines", "cr\r", "nul\0"])
def test_values_pam_env_cannot_carry_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"env\.environment\.A: the value holds"):
        format_assignment("A", value)


def test_bad_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a variable name"):
        format_assignment("1A", "x")


def test_other_lines_and_comments_are_kept_byte_for_byte(root: Root) -> None:
    original = (
        b"# managed by hand\r\n"
        b'PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"\n'
        b"\n"
        b"  # indented comment with bytes \xff\xfe\n"
        b"LANG=C.UTF-8\tweird\n"
        b"NO_NEWLINE_AT_END=1"
    )
    root.path(PATH).write_bytes(original)
    ensure_environment(root, PATH, {"CLOUDSDK_PYTHON": "/usr/bin/python3"})
    assert root.path(PATH).read_bytes() == original + b"\nCLOUDSDK_PYTHON=/usr/bin/python3\n"


def test_wrong_value_is_replaced_where_it_stands() -> None:
    text = "A=1\nCLOUDSDK_PYTHON=/usr/bin/python2\nB=2\n"
    merged, changed = merge_environment(text, {"CLOUDSDK_PYTHON": "/usr/bin/python3"})
    assert merged == "A=1\nCLOUDSDK_PYTHON=/usr/bin/python3\nB=2\n"
    assert changed == ["CLOUDSDK_PYTHON"]


def test_duplicates_of_our_keys_collapse_into_the_first_position() -> None:
    text = "GCS_X=1\nA=1\nGCS_X=2\nB=2\nGCS_X=3\nOTHER=1\nOTHER=1\n"
    merged, changed = merge_environment(text, {"GCS_X": "300"})
    assert merged == "GCS_X=300\nA=1\nB=2\nOTHER=1\nOTHER=1\n"
    assert changed == ["GCS_X"]


def test_same_value_in_another_spelling_is_left_alone() -> None:
    text = 'CLOUDSDK_PYTHON="/usr/bin/python3"\nexport GCS_X=300\n'
    merged, changed = merge_environment(text, {"CLOUDSDK_PYTHON": "/usr/bin/python3", "GCS_X": "300"})
    assert (merged, changed) == (text, [])


def test_commented_and_continued_lines_are_not_assignments() -> None:
    text = "# GCS_X=1\nOTHER=a \\\nGCS_X=continued\n"
    merged, changed = merge_environment(text, {"GCS_X": "300"})
    assert merged == text + "GCS_X=300\n"
    assert changed == ["GCS_X"]


def test_continuation_lines_of_our_key_are_replaced_with_it() -> None:
    text = "GCS_X=1 \\\nstill the value\nB=2\n"
    merged, _ = merge_environment(text, {"GCS_X": "300"})
    assert merged == "GCS_X=300\nB=2\n"


def test_trailing_backslash_on_the_last_line_does_not_swallow_our_line() -> None:
    merged, _ = merge_environment("OTHER=a \\", {"GCS_X": "300"})
    assert merged == "OTHER=a \\\n\nGCS_X=300\n"


def test_hundred_runs_leave_the_file_byte_identical_and_unwritten(root: Root) -> None:
    root.path(PATH).write_bytes(
        b"PATH=/usr/bin\nGCS_READ_REQUEST_TIMEOUT_SECS=1\nGCS_READ_REQUEST_TIMEOUT_SECS=1\n"
    )
    assert ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    first = root.path(PATH).read_bytes()
    inode = root.path(PATH).stat().st_ino
    for _ in range(100):
        assert not ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    assert root.path(PATH).read_bytes() == first
    assert root.path(PATH).stat().st_ino == inode
    assert first.count(b"GCS_READ_REQUEST_TIMEOUT_SECS=") == 1


def test_sourcing_the_file_in_sh_gives_the_values(root: Root) -> None:
    wanted = {**DEFAULT_ENVIRONMENT, "SPACED": "a b # c", "QUOTE": "it's"}
    ensure_environment(root, PATH, wanted)
    script = '. "$1"; shift; for k do eval "v=\\$$k"; printf "%s\\0" "$v"; done'
    run = subprocess.run(
        ["dash", "-c", script, "sh", str(root.path(PATH)), *wanted], capture_output=True, check=True
    )
    assert run.stdout.split(b"\0")[:-1] == [value.encode() for value in wanted.values()]


LINE = st.one_of(
    st.sampled_from(["GCS_A=1", "GCS_A=300", 'GCS_A="300"', "export GCS_B=2", "GCS_B=x \\", "# GCS_A=9", ""]),
    st.text(st.characters(exclude_characters="\n"), max_size=12),
)


@settings(max_examples=300)
@given(lines=st.lists(LINE, max_size=8), final_newline=st.booleans())
def test_property_merge_is_idempotent_and_keeps_foreign_lines(lines: list[str], final_newline: bool) -> None:
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    wanted = {"GCS_A": "300", "GCS_B": "2"}
    merged, _ = merge_environment(text, wanted)
    again, changed = merge_environment(merged, wanted)
    assert (again, changed) == (merged, [])
    logical: list[list[str]] = []  # the physical lines of each line pam_env reads
    continued = False
    for line in text.split("\n"):
        if continued:
            logical[-1].append(line)
        else:
            logical.append([line])
        continued = line.endswith("\\")
    foreign = []  # lines of other keys, including their continuations
    for parts in logical:
        joined = "\n".join(parts).replace("\\\n", "")  # "\\" then "GCS_A=1" is GCS_A's line
        if not joined.lstrip(" \t").startswith(("GCS_A=", "export GCS_B=", "GCS_B=")):
            foreign.extend(line for line in parts if line)
    kept = iter(merged.split("\n"))
    assert all(any(line == candidate for candidate in kept) for line in foreign)
