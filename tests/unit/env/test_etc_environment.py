"""/etc/environment: our keys added once each; an admin's value never overridden nor lost at purge;
every other byte kept; no rewrite when unchanged.

The purge half runs the package's real postrm (debian/tpuboot.postrm) on the test tree.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpuboot.config import DEFAULT_ENVIRONMENT
from tpuboot.env.assignment import PAM_ASSIGNMENT
from tpuboot.env.etc_environment import (
    ENVIRONMENT_RECORD,
    _joined,
    _logical_lines,
    ensure_environment,
    format_assignment,
    plan_environment,
    read_record,
)
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

PATH = "/etc/environment"
POSTRM = Path(__file__).resolve().parents[3] / "debian" / "tpuboot.postrm"
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def purge(root: Root) -> None:
    """The package's postrm purge on ``root`` (DPKG_ROOT: nothing outside the tree is touched)."""
    env = {"PATH": SYSTEM_PATH, "DPKG_ROOT": str(root.path("/"))}
    done = subprocess.run(["sh", str(POSTRM), "purge"], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "could not remove" not in done.stderr


def merged_text(
    text: str, wanted: dict[str, str], recorded: dict[str, frozenset[str]] | None = None
) -> tuple[str, list[str]]:
    """The planned text and the keys whose lines changed (empty: the text unchanged)."""
    plan = plan_environment(text, wanted, recorded)
    return plan.text, plan.changed


def read_env(root: Root) -> str:
    return root.path(PATH).read_bytes().decode() if root.path(PATH).exists() else ""


def record_lines(root: Root) -> list[str]:
    record = root.path(ENVIRONMENT_RECORD)
    return record.read_text().splitlines() if record.exists() else []


def test_missing_file_gets_every_key_in_config_order(root: Root) -> None:
    written = ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    lines = root.path(PATH).read_text().splitlines()
    assert lines == [f"{key}={value}" for key, value in DEFAULT_ENVIRONMENT.items()]
    assert list(written.values()) == lines  # the lines written, by key, as the purge record needs


def test_values_are_quoted_only_when_needed() -> None:
    assert format_assignment("A", "/usr/bin/python3") == "A=/usr/bin/python3"
    assert format_assignment("A", "a b") == 'A="a b"'
    assert format_assignment("A", "") == 'A=""'
    assert format_assignment("A", "it's 1") == 'A="it\'s 1"'


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


def test_own_line_is_replaced_where_it_stands_when_the_configured_value_changes() -> None:
    text = "A=1\nCLOUDSDK_PYTHON=/usr/bin/python2\nB=2\n"
    recorded = {"CLOUDSDK_PYTHON": frozenset({"CLOUDSDK_PYTHON=/usr/bin/python2"})}
    merged, changed = merged_text(text, {"CLOUDSDK_PYTHON": "/usr/bin/python3"}, recorded)
    assert merged == "A=1\nCLOUDSDK_PYTHON=/usr/bin/python3\nB=2\n"
    assert changed == ["CLOUDSDK_PYTHON"]


def test_an_admins_value_is_kept_and_reported() -> None:
    text = "A=1\nCLOUDSDK_PYTHON=/usr/bin/python2\nB=2\n"
    plan = plan_environment(text, {"CLOUDSDK_PYTHON": "/usr/bin/python3"})
    assert (plan.text, plan.changed, plan.written) == (text, [], {})
    assert plan.admin == {"CLOUDSDK_PYTHON": ("/usr/bin/python2", "/usr/bin/python3")}


def test_an_admins_value_is_logged_once_per_process(root: Root, caplog: pytest.LogCaptureFixture) -> None:
    root.path(PATH).write_text("GCS_LOGGED_ONCE=1\n")
    for _ in range(3):
        assert ensure_environment(root, PATH, {"GCS_LOGGED_ONCE": "300"}) == {}
    said = [r.getMessage() for r in caplog.records if "kept the admin's" in r.getMessage()]
    assert said == [
        f"{PATH}: kept the admin's GCS_LOGGED_ONCE='1' (tpuboot's value: '300'); "
        "remove that line to let tpuboot set it"
    ]


def test_repeats_of_one_admin_line_collapse_into_the_first_position() -> None:
    text = "GCS_X=1\nA=1\nGCS_X=1\nB=2\nGCS_X=1\nOTHER=1\nOTHER=1\n"
    merged, changed = merged_text(text, {"GCS_X": "300"})
    assert merged == "GCS_X=1\nA=1\nB=2\nOTHER=1\nOTHER=1\n"
    assert changed == ["GCS_X"]


def test_different_admin_lines_of_one_key_are_all_kept() -> None:
    text = "GCS_X=1\nA=1\nGCS_X=2\nGCS_X=1\n"
    plan = plan_environment(text, {"GCS_X": "300"})
    assert (plan.text, plan.changed) == (text, [])
    assert plan.admin == {"GCS_X": ("1", "300")}  # the last assignment is the one read


def test_same_value_in_another_spelling_is_left_alone() -> None:
    text = 'CLOUDSDK_PYTHON="/usr/bin/python3"\nexport GCS_X=300\n'
    merged, changed = merged_text(text, {"CLOUDSDK_PYTHON": "/usr/bin/python3", "GCS_X": "300"})
    assert (merged, changed) == (text, [])


def test_commented_and_continued_lines_are_not_assignments() -> None:
    text = "# GCS_X=1\nOTHER=a \\\nGCS_X=continued\n"
    merged, changed = merged_text(text, {"GCS_X": "300"})
    assert merged == text + "GCS_X=300\n"
    assert changed == ["GCS_X"]


def test_an_admins_continued_line_of_our_key_is_kept_whole() -> None:
    text = "GCS_X=1 \\\nstill the value\nB=2\n"
    assert merged_text(text, {"GCS_X": "300"}) == (text, [])


def test_trailing_backslash_on_the_last_line_does_not_swallow_our_line() -> None:
    merged, _ = merged_text("OTHER=a \\", {"GCS_X": "300"})
    assert merged == "OTHER=a \\\n\nGCS_X=300\n"


def test_hundred_runs_leave_the_file_byte_identical_and_unwritten(root: Root) -> None:
    root.path(PATH).write_bytes(
        b"PATH=/usr/bin\nGCS_READ_REQUEST_TIMEOUT_SECS=1\nGCS_READ_REQUEST_TIMEOUT_SECS=1\n"
    )
    assert ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    first = root.path(PATH).read_bytes()
    inodes = root.path(PATH).stat().st_ino, root.path(ENVIRONMENT_RECORD).stat().st_ino
    for _ in range(100):
        assert not ensure_environment(root, PATH, DEFAULT_ENVIRONMENT)
    assert root.path(PATH).read_bytes() == first
    assert (root.path(PATH).stat().st_ino, root.path(ENVIRONMENT_RECORD).stat().st_ino) == inodes
    assert first.count(b"GCS_READ_REQUEST_TIMEOUT_SECS=1\n") == 1  # the admin's, once


def test_sourcing_the_file_in_sh_gives_the_values(root: Root) -> None:
    wanted = {**DEFAULT_ENVIRONMENT, "SPACED": "a b ; c", "QUOTE": "it's"}
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


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(LINE, max_size=8), final_newline=st.booleans())
def test_property_merge_is_idempotent_and_keeps_foreign_lines(lines: list[str], final_newline: bool) -> None:
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    wanted = {"GCS_A": "300", "GCS_B": "2"}
    merged, _ = merged_text(text, wanted)
    again, changed = merged_text(merged, wanted)
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


# --- An admin's value through boot and purge: the file, the record, what purge leaves ----------
# Each case: /etc/environment and the record as found at boot (K configured as 300); the file and
# record tpuboot leaves; the file the package's purge leaves. "Before" says what the code before an
# admin's value won did: each case under one lost the admin's value at purge.

WANTED = {"K": "300"}


# fmt: off
SURVIVES = [
    # (id, found, recorded, after boot, record after boot, after purge)
    ("absent: added, removed at purge", "", "", "K=300\n", ["K=300"], ""),
    ("a comment is no value", "# K=600\n", "", "# K=600\nK=300\n", ["K=300"], "# K=600\n"),
    ("own line follows config", "A=1\nK=200\nB=2\n", "K=200", "A=1\nK=300\nB=2\n", ["K=300"], "A=1\nB=2\n"),
    ("admin respelled our line", " export  K=300\n", "K=300", " export  K=300\n", [], " export  K=300\n"),
    # Before: replaced by K=300 at boot (or put back to it), deleted at purge.
    ("admin's value before tpuboot", "K=600\n", "", "K=600\n", [], "K=600\n"),
    ("admin's other spelling", 'export K="600"\n', "", 'export K="600"\n', [], 'export K="600"\n'),
    ("admin's continued line", "K=1 \\\n2\n", "", "K=1 \\\n2\n", [], "K=1 \\\n2\n"),
    ("admin's CRLF line", "K=300\r\n", "K=300", "K=300\r\n", [], "K=300\r\n"),
    ("admin edited our line", "A=1\nK=900\n", "K=300", "A=1\nK=900\n", [], "A=1\nK=900\n"),
    # Before: collapsed into one K=300 at the first position, deleted at purge.
    ("admin's different lines", "K=1\nA=1\nK=2\n", "", "K=1\nA=1\nK=2\n", [], "K=1\nA=1\nK=2\n"),
    ("admin's repeated other value", "K=600\nK=600\n", "", "K=600\n", [], "K=600\n"),
    ("admin's line above ours", "K=600\nK=300\n", "K=300", "K=600\n", [], "K=600\n"),
    ("admin's line below ours", "K=300\nK=600\n", "K=300", "K=600\n", [], "K=600\n"),
    # Before: the admin's line equal to ours was recorded as ours (or taken for it), deleted at purge.
    ("admin's repeats equal ours", "K=300\nA=1\nK=300\n", "", "K=300\nA=1\n", [], "K=300\nA=1\n"),
    ("admin repeated our line", "K=300\nB=1\nK=300\n", "K=300", "B=1\nK=300\n", [], "B=1\nK=300\n"),
    # Before: the postrm deleted the continuation line, changing A's value.
    ("continuation equal to ours", "A=x \\\nK=300\n", "K=300", "A=x \\\nK=300\nK=300\n", ["K=300"],
     "A=x \\\nK=300\n"),
]
# fmt: on


@pytest.mark.parametrize(
    ("found", "recorded", "after_boot", "after_record", "after_purge"),
    [pytest.param(*case[1:], id=case[0]) for case in SURVIVES],
)
def test_an_admins_value_survives_boot_and_purge(
    root: Root, found: str, recorded: str, after_boot: str, after_record: list[str], after_purge: str
) -> None:
    root.path(PATH).write_bytes(found.encode())
    if recorded:
        root.path(ENVIRONMENT_RECORD).parent.mkdir(parents=True)
        root.path(ENVIRONMENT_RECORD).write_text(recorded + "\n")
    ensure_environment(root, PATH, WANTED)
    assert (read_env(root), record_lines(root)) == (after_boot, after_record)
    purge(root)
    assert read_env(root) == after_purge


def test_the_admin_repeats_our_line_after_the_last_boot_purge_removes_one(root: Root) -> None:
    """Before: the postrm deleted every line equal to one tpuboot wrote, the admin's copy too."""
    ensure_environment(root, PATH, {"K": "300", "L": "1"})
    with root.path(PATH).open("a") as f:
        f.write("K=300\nL=1")  # the admin's, without a final newline
    purge(root)
    assert read_env(root) == "K=300\nL=1"


def test_purge_without_a_record_or_with_a_blank_line_in_it_keeps_everything(root: Root) -> None:
    root.path(PATH).write_text("A=1\n\nK=300\n")
    purge(root)
    assert read_env(root) == "A=1\n\nK=300\n"
    root.path(ENVIRONMENT_RECORD).parent.mkdir(parents=True)
    root.path(ENVIRONMENT_RECORD).write_text("\n\n")
    purge(root)
    assert read_env(root) == "A=1\n\nK=300\n"


def test_the_record_is_ahead_of_the_file_so_a_crash_never_claims_an_admins_line(
    root: Root, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file write fails after the record's first update: the admin's line is not recorded, and
    the line about to be written is (a record line that does not stand is harmless)."""
    root.path(PATH).write_text("K=300\nB=1\nK=300\n")  # ours first, the admin's repeat after
    root.path(ENVIRONMENT_RECORD).parent.mkdir(parents=True)
    root.path(ENVIRONMENT_RECORD).write_text("K=300\n")
    from tpuboot.env import etc_environment as environment

    real = environment.write_file

    def failing(root_: Root, path: str, data: bytes, **kwargs: object) -> bool:
        if path == PATH:
            raise OSError("disk full")
        return real(root_, path, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(environment, "write_file", failing)
    with pytest.raises(OSError):
        ensure_environment(root, PATH, {"K": "300", "NEW": "1"})
    assert record_lines(root) == ["NEW=1"]  # K given up before the file; NEW recorded ahead
    purge(root)
    assert read_env(root) == "K=300\nB=1\nK=300\n"


def pam_env_values(text: str) -> dict[str, str]:
    """What pam_env reads: logical lines, ``#`` comments, optional export, the last assignment wins."""
    import re

    values: dict[str, str] = {}
    for line in re.split(r"(?<!\\)\n", text):
        line = line.replace("\\\n", "").removesuffix("\\")
        match = re.match(r"[ \t]*(?:export[ \t]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z", line, re.DOTALL)
        if match:
            value = match.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            values[match.group(1)] = value
    return values


ADMIN_LINE = st.one_of(
    st.sampled_from(
        [
            "GCS_A=1",
            "GCS_A=300",
            'GCS_A="300"',
            "export GCS_B=2",
            "GCS_B=7",
            "GCS_B=x \\",
            "# GCS_A=9",
            "",
            "X=1",
        ]
    ),
    st.text(st.characters(exclude_characters="\n\0", max_codepoint=0x7F), max_size=10),
)


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(ADMIN_LINE, max_size=6),
    final_newline=st.booleans(),
    first=st.sampled_from(["300", "1", "9"]),
    second=st.sampled_from(["300", "2", "9"]),
)
def test_property_boots_then_purge_leave_the_admins_values(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], final_newline: bool, first: str, second: str
) -> None:
    """Two boots (the configured value changing between them), then purge: every value the admin's
    file gave is read as before, and none of tpuboot's is left."""
    top = tmp_path_factory.mktemp("root")
    (top / "etc").mkdir()
    root = Root(top)
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    root.path(PATH).write_text(text)
    ensure_environment(root, PATH, {"GCS_A": first, "GCS_B": "2"})
    ensure_environment(root, PATH, {"GCS_A": second, "GCS_B": "2"})
    purge(root)
    assert pam_env_values(read_env(root)) == pam_env_values(text)
    assert not os.path.exists(root.path(ENVIRONMENT_RECORD))


# --- The postrm's rule of which lines are tpuboot's, against the Python one -----------------------
# At purge tpuboot's files are gone, so debian/tpuboot.postrm cannot ask tpuboot which lines of
# /etc/environment are its own: the record lists them exactly, and the postrm's awk states again
# the one rule the record does not carry (a line is tpuboot's where it stands whole, as pam_env
# splits lines, byte for byte as recorded: never a continuation of the line above). Making the
# record carry that too (line positions) would change its format under every installed tpuboot;
# so this runs the real postrm and the Python rule (plan_environment's) on the same generated
# files, byte for byte.


def tpuboots_lines(root: Root, text: str) -> str:
    """``text`` without the lines plan_environment takes for tpuboot's (per key, the first whole
    line as recorded), every other byte kept; a file without a final newline stays so."""
    lines = _logical_lines(text)
    keys = [match.group(1) if (match := PAM_ASSIGNMENT.match(_joined(line))) else None for line in lines]
    drop = set()
    for key, mine in read_record(root).items():
        ours = (i for i, line in enumerate(lines) if keys[i] == key and line.removesuffix("\n") in mine)
        drop.update(list(ours)[:1])
    kept = "".join(line for i, line in enumerate(lines) if i not in drop)
    return kept[:-1] if kept.endswith("\n") and not text.endswith("\n") else kept


#: Lines like tpuboot's, the admin's repeats and edits of them, and a line the next one continues.
NEAR_OURS = st.sampled_from(
    ["GCS_A=300", "GCS_A=1", "GCS_B=2", "GCS_B=x \\", "GCS_A=300\r", "# c", "", "X=1"]
)


@settings(max_examples=200, deadline=None)
# A continuation equal to tpuboot's line, with a line between it and tpuboot's: removing the
# continuation instead would change the bytes (and GCS_B's value).
@example(
    before=["GCS_B=x \\", "GCS_A=300", "X=1"],
    after=["GCS_A=300"],
    final_newline=False,
    first="300",
    second="300",
)
@given(
    before=st.lists(NEAR_OURS, max_size=5),
    after=st.lists(NEAR_OURS, max_size=5),
    final_newline=st.booleans(),
    first=st.sampled_from(["300", "1"]),
    second=st.sampled_from(["300", "2"]),
)
def test_property_the_postrm_removes_exactly_the_lines_python_takes_for_tpuboots(
    tmp_path_factory: pytest.TempPathFactory,
    before: list[str],
    after: list[str],
    final_newline: bool,
    first: str,
    second: str,
) -> None:
    top = tmp_path_factory.mktemp("root")
    (top / "etc").mkdir()
    root = Root(top)
    root.path(PATH).write_text("\n".join(before) + ("\n" if before else ""))
    ensure_environment(root, PATH, {"GCS_A": first, "GCS_B": "2"})
    ensure_environment(root, PATH, {"GCS_A": second, "GCS_B": "2"})
    with root.path(PATH).open("a") as f:  # the admin's lines after tpuboot's, a repeat of one among them
        f.write("\n".join(after) + ("\n" if final_newline and after else ""))
    text = read_env(root)
    expected = tpuboots_lines(root, text)
    purge(root)
    assert read_env(root) == expected
