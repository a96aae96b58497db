"""The next-boot reader against dash and the kernel: generated GRUB fragments sourced by dash the way
update-grub does, and the command line split the way the kernel splits it.

The reader may say it cannot tell (Unreadable, a WARN); it may never give a value dash would not,
nor PASS a parameter the kernel will not get.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuboot import cli
from tpuboot.checks.image import run_checks
from tpuboot.checks.parsers.cmdline import Param, grub_linux_line, kernel_params
from tpuboot.checks.parsers.grub import Unreadable, next_boot
from tpuboot.env.tpuenv import shell_quote
from tpuboot.paths import Root

DASH = "/bin/dash"  # update-grub's /bin/sh on Debian and Ubuntu; dash is Essential
# grub-mkconfig's own order (util/grub-mkconfig.in): /etc/default/grub if a regular file, then
# each existing grub.d/*.cfg in glob order; `set -e` ends the run on a failing file.
UPDATE_GRUB = """set -e
if test -f "$R/etc/default/grub" ; then . "$R/etc/default/grub"; fi
for x in "$R"/etc/default/grub.d/*.cfg ; do
  if [ -e "${x}" ]; then . "${x}"; fi
done
printf '%s\\0%s' "$GRUB_CMDLINE_LINUX" "$GRUB_CMDLINE_LINUX_DEFAULT"
"""


def dash_sources(top: Path) -> tuple[str, str] | None:
    """GRUB_CMDLINE_LINUX and _DEFAULT after dash sourced the tree's files; None if dash failed."""
    out = subprocess.run(
        [DASH, "-c", UPDATE_GRUB],
        capture_output=True,
        env={"R": str(top), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        cwd=top,
        timeout=30,
        check=False,
    )
    if out.returncode != 0:
        return None
    linux, default = out.stdout.decode("utf-8", "surrogateescape").split("\0")
    return linux, default


def write_tree(top: Path, grub: str | None, dropins: dict[bytes, str]) -> Root:
    if grub is not None:
        (top / "etc/default").mkdir(parents=True, exist_ok=True)
        (top / "etc/default/grub").write_text(grub, encoding="utf-8")
    for name, text in dropins.items():
        (top / "etc/default/grub.d").mkdir(parents=True, exist_ok=True)
        (top / "etc/default/grub.d" / os.fsdecode(name)).write_text(text, encoding="utf-8")
    return Root(top)


def read_both(root: Root) -> tuple[str, str] | None:
    """The reader's values, or None when it says it cannot tell."""
    try:
        boot = next_boot(root, "amd64")
    except Unreadable:
        return None
    return None if boot is None else (boot.linux, boot.default)


def idle_check(root: Root) -> str:
    return run_checks(root, ["cmdline-idle-poll"], next_boot=True)[0].status


# --- the classes the red team found, and cases of the same kind -----------------------------------


@pytest.mark.parametrize(
    "name", [b".x.cfg", b".cfg", b"x.cfg~", b"x.cfg.bak", b"x.CFG", b"x.cfg.dpkg-old", b"x.cfg/"]
)
def test_a_file_the_glob_skips_is_not_read(tmp_path: Path, name: bytes) -> None:
    top = tmp_path / "t"
    if name.endswith(b"/"):  # a directory whose file matches only one level down
        name = name + b"inner.cfg"
        (top / "etc/default/grub.d" / os.fsdecode(name)).parent.mkdir(parents=True)
    root = write_tree(top, 'GRUB_CMDLINE_LINUX="quiet"\n', {name: 'GRUB_CMDLINE_LINUX="idle=poll"\n'})
    assert read_both(root) == dash_sources(top) == ("quiet", "")
    assert idle_check(root) == "FAIL"


def test_a_directory_named_cfg_is_nothing_and_a_fifo_cannot_be_told(tmp_path: Path) -> None:
    root = write_tree(tmp_path, 'GRUB_CMDLINE_LINUX="idle=poll"\n', {})
    (tmp_path / "etc/default/grub.d/50-dir.cfg").mkdir(parents=True)
    assert read_both(root) == dash_sources(tmp_path) == ("idle=poll", "")  # dash sources it as nothing
    os.mkfifo(tmp_path / "etc/default/grub.d/60-fifo.cfg")  # dash would block reading it
    assert read_both(root) is None and idle_check(root) == "WARN"


@pytest.mark.parametrize(
    "separator",
    ["\u00a0", "\u2003", "\u3000", "\u202f", "\u2028", "\x85", "\x0b", "\x0c", "\r"],
)
def test_a_pasted_space_is_not_a_separator_unless_the_kernel_says_so(tmp_path: Path, separator: str) -> None:
    line = f"quiet{separator}idle=poll"
    root = write_tree(tmp_path, f'GRUB_CMDLINE_LINUX="{line}"\n', {})
    assert read_both(root) == dash_sources(tmp_path) == (line, "")
    # The kernel splits at ASCII white space and at the byte 0xA0, the last of UTF-8's C2 A0: before
    # idle=poll that leaves it whole, after it the kernel gets idle=poll\xc2.
    ascii_space = separator in "\x0b\x0c\r"
    assert idle_check(root) == ("PASS" if ascii_space or separator == "\u00a0" else "FAIL")
    after = write_tree(tmp_path / "after", f'GRUB_CMDLINE_LINUX="idle=poll{separator}quiet"\n', {})
    assert idle_check(after) == ("PASS" if ascii_space else "FAIL")


def test_a_no_break_space_on_the_running_kernel_line_fails_and_shows_the_byte(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_bytes("root=/dev/vda ro idle=poll\u00a0quiet\n".encode())
    result = run_checks(Root(tmp_path), ["cmdline-idle-poll"])[0]
    assert result.status == "FAIL"
    assert "idle=poll\\xc2" in result.detail


def test_a_running_kernel_line_that_is_not_utf8_is_read_as_bytes(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_bytes(b"root=/dev/vda \xff idle=poll\n")
    assert run_checks(Root(tmp_path), ["cmdline-idle-poll"])[0].status == "PASS"


@pytest.mark.parametrize(
    ("grub", "linux"),
    [
        ("GRUB_CMDLINE_LINUX=idle=poll#x\n", "idle=poll#x"),
        ("GRUB_CMDLINE_LINUX=#idle=poll\n", "#idle=poll"),
        ('GRUB_CMDLINE_LINUX="quiet" #idle=poll\n', "quiet"),
        ("GRUB_CMDLINE_LINUX=quiet\\ #idle=poll\n", "quiet #idle=poll"),
        ("GRUB_CMDLINE_LINUX=quiet;#idle=poll\n", "quiet"),
        ("GRUB_CMDLINE_LINUX='a'#b\n", "a#b"),
        ('GRUB_CMDLINE_LINUX= #"idle=poll"\n', ""),
        ("GRUB_CMDLINE_LINUX=a\\\n#b\n", "a#b"),
    ],
)
def test_a_hash_inside_a_word_is_literal_as_in_sh(tmp_path: Path, grub: str, linux: str) -> None:
    root = write_tree(tmp_path, grub, {})
    assert read_both(root) == dash_sources(tmp_path) == (linux, "")


def test_a_hash_in_the_value_reaches_grub_and_is_judged_there(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "GRUB_CMDLINE_LINUX=idle=poll#x\n", {})
    assert idle_check(root) == "FAIL"  # the kernel gets idle=poll#x
    root = write_tree(tmp_path / "b", 'GRUB_CMDLINE_LINUX="quiet #idle=poll"\n', {})
    assert idle_check(root) == "WARN"  # a comment to GRUB's own parser: cannot tell


@pytest.mark.parametrize(
    "grub",
    [
        "GRUB_CMDLINE_LINUX=idle=poll" + " \\\n" * 1200 + "\n",
        "GRUB_CMDLINE_LINUX=idle\\\n" * 1 + "=poll\n" + "\\\n" * 5000,
        'GRUB_CMDLINE_LINUX="idle=poll' + "\\\n" * 3000 + '"\n',
        "\\\n" * 3000 + "GRUB_CMDLINE_LINUX=idle=poll\n",
        "GRUB_CMDLINE_LINUX=idle=poll" + ";" + " \\\n" * 3000 + "\n",
    ],
)
def test_many_continuation_lines_are_read_without_recursion(tmp_path: Path, grub: str) -> None:
    root = write_tree(tmp_path, grub, {})
    assert read_both(root) == dash_sources(tmp_path) == ("idle=poll", "")


@pytest.mark.parametrize(
    "dropin",
    [
        "GRUB_CMDLINE_LINUX=$GRUB_CMDLINE_LINUX\\\nGRUB_CMDLINE_LINUX=\n",  # found by hypothesis
        'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX\\\nX idle=poll"\n',
        "GRUB_CMDLINE_LINUX=$GRUB_CMDLINE_LINUX\\\n\\\n_DEFAULT\n",
        "GRUB_CMDLINE_LINUX=${GRUB_CMDLINE\\\n_LINUX}\n",
    ],
)
def test_a_backslash_newline_inside_a_name_is_never_read_as_its_end(tmp_path: Path, dropin: str) -> None:
    """sh joins the lines before it reads a name: ``$A\\<newline>B`` is ``$AB``, not ``$A`` then B."""
    root = write_tree(tmp_path, "GRUB_CMDLINE_LINUX=idle=poll\n", {b"a.cfg": dropin})
    assert dash_sources(tmp_path) is not None
    assert read_both(root) is None  # cannot tell: never a value dash would not give


def test_a_backslash_newline_after_a_name_ends_it(tmp_path: Path) -> None:
    root = write_tree(
        tmp_path,
        "GRUB_CMDLINE_LINUX=idle=poll\n",
        {b"a.cfg": 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX\\\n x"\n'},
    )
    assert read_both(root) == dash_sources(tmp_path) == ("idle=poll x", "")


def test_a_file_name_that_is_not_utf8_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_tree(
        tmp_path,
        'GRUB_CMDLINE_LINUX="idle=poll"\n',
        {b"50-\xff\xfe.cfg": "echo hi\n", b"40-\xe9t\xe9.cfg": "GRUB_CMDLINE_LINUX_DEFAULT=quiet\n"},
    )
    result = run_checks(root, ["cmdline-idle-poll"], next_boot=True)[0]
    assert result.status == "WARN" and "50-\\xff\\xfe.cfg line 1" in result.detail
    assert cli.main(["--root", str(tmp_path), "image-check", "--only", "cmdline-idle-poll"]) == 0
    assert "50-\\xff\\xfe.cfg line 1" in capsys.readouterr().out
    assert cli.main(["--root", str(tmp_path), "image-check", "--json"]) in (0, 1)
    shown = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "50-\\xff\\xfe.cfg line 1" in shown["cmdline-idle-poll"]["detail"]


def test_dot_files_and_odd_names_sort_as_dashs_glob(tmp_path: Path) -> None:
    names = [b"10-a.cfg", b"9.cfg", b"A.cfg", b"_.cfg", b"\xc3\xa9.cfg", b"-.cfg", b"10-A.cfg"]
    dropins = {name: f'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX {i}"\n' for i, name in enumerate(names)}
    root = write_tree(tmp_path, None, dropins)
    assert read_both(root) == dash_sources(tmp_path)


# --- the kernel's splitting ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "params"),
    [
        (b"a b=c", [("a", None), ("b", "c")]),
        (b'  a="x y"  b', [("a", "x y"), ("b", None)]),
        (b'"a=x y" b', [("a", "x y"), ("b", None)]),
        (b'a=x"y z"', [("a", 'x"y z"')]),
        (b"idle=poll\xc2\xa0quiet", [("idle", "poll\\xc2"), ("quiet", None)]),
        (b"a\x0bb\x0cc\rd\te\nf", [(n, None) for n in "abcdef"]),
        (b"a -- idle=poll", [("a", None)]),
        (b"transparent-hugepage=always", [("transparent_hugepage", "always")]),
        (b"a=", [("a", "")]),
        (b'a="', [("a", "")]),
        (b"", []),
    ],
)
def test_kernel_params_split_as_lib_cmdline_does(line: bytes, params: list[tuple[str, str | None]]) -> None:
    assert kernel_params(line) == [Param(name, value) for name, value in params]


def test_grub_quotes_a_word_with_a_space_and_reinterprets_the_rest() -> None:
    assert grub_linux_line('a="x y" idle="poll"', "") == b'"a=x y" idle=poll'
    assert kernel_params(grub_linux_line('a="x y" idle="poll"', "quiet")) == [
        Param("a", "x y"),
        Param("idle", "poll"),
        Param("quiet", None),
    ]


@pytest.mark.parametrize("value", ["a=$x idle=poll", "a='x' idle=poll", "a\\b idle=poll", 'a="b idle=poll'])
def test_what_grub_would_reinterpret_cannot_be_told(tmp_path: Path, value: str) -> None:
    root = write_tree(tmp_path, f"GRUB_CMDLINE_LINUX={shell_quote(value)}\n", {})
    assert read_both(root) == dash_sources(tmp_path) == (value, "")
    assert idle_check(root) == "WARN"


# --- differential: generated fragments against dash -----------------------------------------------

NAMES = ["GRUB_CMDLINE_LINUX", "GRUB_CMDLINE_LINUX_DEFAULT", "GRUB_X", "A", "b_2"]
REFS = [*NAMES, "HOME", "PWD", "UNSET"]
_plain = st.text(alphabet="abz09=,._-/:#*?[]!{}%+@\u00a0\u00e9", min_size=1, max_size=6)
_sq_text = st.text(alphabet='ab =#$"\\`\n\u00a0;()', max_size=6)
_dq_piece = st.one_of(
    st.text(alphabet="ab =#';()\n\u00a0~", min_size=1, max_size=5),
    st.sampled_from(['\\"', "\\\\", "\\$", "\\`", "\\a", "\\\n", "\\ "]),
    st.sampled_from(REFS).map(lambda n: f"${n}"),
    st.sampled_from(REFS).map(lambda n: f"${{{n}}}"),
)
_piece = st.one_of(
    _plain,
    _sq_text.map(lambda t: f"'{t}'"),
    st.lists(_dq_piece, max_size=4).map(lambda ps: '"' + "".join(ps) + '"'),
    st.sampled_from(["\\ ", "\\#", "\\a", "\\\n", "\\'", '\\"', "\\;", "~", "$(echo x)", "`echo y`"]),
    st.sampled_from(REFS).map(lambda n: f"${n}"),
    st.sampled_from(REFS).map(lambda n: f"${{{n}}}"),
)
_value = st.lists(_piece, max_size=4).map("".join)
_assignment = st.tuples(st.sampled_from(NAMES), _value).map(lambda p: f"{p[0]}={p[1]}")
_blank = st.sampled_from([" ", "\t", "  ", " \\\n", "\\\n"])
_end = st.sampled_from(["\n", ";\n", " # note\n", "#x\n", "; ", ";", "\n\n", " ;; \n", "\n# a\\\n"])
_statement = st.one_of(
    st.tuples(
        st.sampled_from(["", "export ", "export\t", " "]),
        st.lists(_assignment, min_size=1, max_size=3),
        _blank,
        _end,
    ).map(lambda p: p[0] + p[2].join(p[1]) + p[3]),
    st.sampled_from(["# comment\n", "\n", "   \n", "echo hi\n", ";\n", "A=1 true\n", 'A="x\n', "${A:-b}\n"]),
)
_fragment = st.lists(_statement, max_size=6).map("".join)
_dropin_names = st.sampled_from([b"10-a.cfg", b"20-b.cfg", b".hidden.cfg", b"30-c.cfg.bak", b"\xff.cfg"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    grub=st.one_of(st.none(), _fragment),
    dropins=st.dictionaries(_dropin_names, _fragment, max_size=3),
)
def test_the_reader_never_gives_what_dash_would_not(
    tmp_path_factory: pytest.TempPathFactory, grub: str | None, dropins: dict[bytes, str]
) -> None:
    top = tmp_path_factory.mktemp("g")
    root = write_tree(top, grub, dropins)
    mine = read_both(root)
    if mine is not None:
        assert dash_sources(top) == mine


def test_the_generator_reaches_values_the_reader_can_tell(tmp_path: Path) -> None:
    """A guard on the generated test: the shapes it draws are mostly ones the reader reads."""
    samples = [
        "A='x y'#z B=\"$A \\$q\" GRUB_CMDLINE_LINUX=${A}a\\ b\n",
        'export GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_X\\a" \\\n GRUB_X=1;GRUB_CMDLINE_LINUX=$GRUB_X\n',
    ]
    for i, text in enumerate(samples):
        root = write_tree(tmp_path / str(i), text, {})
        mine = read_both(root)
        assert mine is not None and mine == dash_sources(tmp_path / str(i))


# --- linear in the input ---------------------------------------------------------------------------


def _cpu_seconds_to_read(root: Root) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        next_boot(root, "amd64")
        best = min(best, time.process_time() - start)
    return best


def test_reading_is_linear_in_the_file_size(tmp_path: Path) -> None:
    """1x and 4x the same mix of statements: the quadratic reader took 16x (65 s for 1 MiB); a
    linear one about 4x. A ratio, so the machine's speed does not matter."""
    unit = (
        "GRUB_X=\"a b c\" \\\n  A='x'y#z; B=$A${GRUB_X}\\ q # c\n"
        + 'export GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX"\n'
    )
    small = write_tree(tmp_path / "s", unit * 2500, {})
    large = write_tree(tmp_path / "l", unit * 10000, {})
    assert len((tmp_path / "l/etc/default/grub").read_bytes()) < 1 << 20
    ratio = _cpu_seconds_to_read(large) / _cpu_seconds_to_read(small)
    print(f"4x the input took {ratio:.1f}x the CPU time", file=sys.stderr)
    assert ratio < 9
