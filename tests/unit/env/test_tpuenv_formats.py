"""tpu-env for systemd's EnvironmentFile= and `docker run --env-file`: each read back by a port of
its reader, and written by EnvSync beside tpu-env. The VM test (tests/vm/test_tpuboot_envfiles.py)
has systemd itself and a real docker read them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.config import ConfigError, parse_config
from tpuboot.env.sync import EnvSync
from tpuboot.env.tpuenv import (
    DOCKER_MAX_LINE,
    GENERATED_HEADER,
    parse_tpu_env,
    render_docker_env_file,
    render_env_file,
    render_systemd_env_file,
)
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

SYSTEMD = "/run/tpuboot/tpu-env.env"
DOCKER = "/run/tpuboot/tpu-env.docker"
NEWLINE_KEYS = ["BACKSLASH_NEWLINE", "NEWLINE", "TRAILING_NEWLINE"]

_WHITESPACE, _NEWLINE, _COMMENTS, _NEED_ESCAPE = " \t\n\r", "\n\r", "#;", '"\\`$'


def systemd_load_env_file(text: str) -> dict[str, str]:
    """A port of systemd's parse_env_file_internal + load_env_file_push (src/basic/env-file.c,
    the state machine of 249 to 257): what EnvironmentFile= gives a unit."""
    out: dict[str, str] = {}
    state, key, value = "PRE_KEY", "", None
    key_ws = value_ws = None  # where trailing whitespace of the key / an unquoted value begins

    def push() -> None:
        nonlocal key, value
        name = key[:key_ws] if key_ws is not None else key
        out[name] = value or ""
        key, value = "", None

    for c in text:
        if state == "PRE_KEY":
            if c in _COMMENTS:
                state = "COMMENT"
            elif c not in _WHITESPACE:
                state, key, key_ws = "KEY", c, None
        elif state == "KEY":
            if c in _NEWLINE:
                state, key = "PRE_KEY", ""
            elif c == "=":
                state, value_ws = "PRE_VALUE", None
            else:
                if c not in _WHITESPACE:
                    key_ws = None
                elif key_ws is None:
                    key_ws = len(key)
                key += c
        elif state == "PRE_VALUE":
            if c in _NEWLINE:
                state = "PRE_KEY"
                push()
            elif c == "'":
                state = "SINGLE"
            elif c == '"':
                state = "DOUBLE"
            elif c == "\\":
                state = "VALUE_ESCAPE"
            elif c not in _WHITESPACE:
                state, value = "VALUE", (value or "") + c
        elif state == "VALUE":
            if c in _NEWLINE:
                state = "PRE_KEY"
                if value_ws is not None and value is not None:
                    value = value[:value_ws]
                push()
            elif c == "\\":
                state, value_ws = "VALUE_ESCAPE", None
            else:
                if c not in _WHITESPACE:
                    value_ws = None
                elif value_ws is None:
                    value_ws = len(value or "")
                value = (value or "") + c
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in _NEWLINE:
                value = (value or "") + c
        elif state == "SINGLE":
            if c == "'":
                state = "PRE_VALUE"
            else:
                value = (value or "") + c
        elif state == "DOUBLE":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DOUBLE_ESCAPE"
            else:
                value = (value or "") + c
        elif state == "DOUBLE_ESCAPE":
            state = "DOUBLE"
            if c in _NEED_ESCAPE:
                value = (value or "") + c
            elif c != "\n":
                value = (value or "") + "\\" + c
        elif state == "COMMENT" and c in _NEWLINE:
            state = "PRE_KEY"
    if state not in ("PRE_KEY", "KEY", "COMMENT"):
        if state == "VALUE" and value_ws is not None and value is not None:
            value = value[:value_ws]
        push()
    return out


def docker_env_file(text: str) -> dict[str, str]:
    """A port of docker/cli's parseKeyValueFile (opts/envfile.go): bufio.ScanLines (a ``\\r``
    before the newline dropped), leading whitespace trimmed, ``#`` lines skipped, split at the
    first ``=``, the value kept as it is."""
    out: dict[str, str] = {}
    for raw in text.split("\n")[: -1 if text.endswith("\n") else None]:
        line = raw.removesuffix("\r").lstrip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        assert key and not any(c in key for c in " \t"), f"docker refuses the line {line!r}"
        out[key] = value
    return out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=  b  \n", {"A": "b"}),
        ('A="x"y\n', {"A": "xy"}),
        ("A='a\\b'\n", {"A": "a\\b"}),
        ('A="a\\nb"\n', {"A": "a\\nb"}),  # an unknown escape keeps its backslash
        ('A="a\\\nb"\n', {"A": "ab"}),  # a continuation line
        ("# c\n ; c\nA=1 \\\n2\n", {"A": "1 2"}),
    ],
)
def test_the_systemd_port_reads_as_systemd_does(text: str, expected: dict[str, str]) -> None:
    assert systemd_load_env_file(text) == expected


def test_every_hostile_value_reaches_systemd_byte_for_byte() -> None:
    values = {**SAMPLE_TPU_ENV, **HOSTILE_VALUES, "LONG": "x" * 100_000}
    text, skipped = render_systemd_env_file(values)
    assert text.startswith(GENERATED_HEADER) and not skipped
    assert systemd_load_env_file(text) == values


def test_docker_gets_every_value_it_can_carry_and_the_rest_is_left_out_whole() -> None:
    values = {**SAMPLE_TPU_ENV, **HOSTILE_VALUES, "ENDS_CR": "a\r", "LEADING": "\t x"}
    text, skipped = render_docker_env_file(values)
    assert sorted(skipped) == sorted([*NEWLINE_KEYS, "ENDS_CR"])
    assert all("newline" in skipped[key] for key in NEWLINE_KEYS)
    assert "carriage return" in skipped["ENDS_CR"]
    assert docker_env_file(text) == {k: v for k, v in values.items() if k not in skipped}
    assert text.count("\n") == 1 + len(values) - len(skipped)  # never a stray line


# Text as tpu-env accepts it (no NUL, no lone surrogates), weighted to what the readers treat specially.
VALUES = st.text(
    st.one_of(
        st.sampled_from(list(" \t\n\r\"'\\$`#;=")),
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
    ),
    max_size=20,
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(NAMES, VALUES, max_size=6))
def test_any_value_reaches_systemd_and_docker_exactly_or_is_named(values: dict[str, str]) -> None:
    text, skipped = render_systemd_env_file(values)
    assert systemd_load_env_file(text) == {k: v for k, v in values.items() if k not in skipped}
    text, skipped = render_docker_env_file(values)
    assert docker_env_file(text) == {k: v for k, v in values.items() if k not in skipped}


def test_a_line_longer_than_dockers_buffer_is_left_out() -> None:
    fits = "x" * (DOCKER_MAX_LINE - len("FITS="))
    text, skipped = render_docker_env_file({"FITS": fits, "OVER": fits + "yy"})
    assert list(skipped) == ["OVER"] and "65535" in skipped["OVER"]
    assert docker_env_file(text) == {"FITS": fits}


def test_the_shell_file_is_unchanged() -> None:
    assert render_systemd_env_file(HOSTILE_VALUES) == (GENERATED_HEADER + render_env_file(HOSTILE_VALUES), {})


# --- EnvSync writes them ---------------------------------------------------------------------


@pytest.fixture
def hostile_emulator(emulator: MetadataEmulator) -> MetadataEmulator:
    emulator.set_attribute("tpu-env", tpu_env_yaml({**SAMPLE_TPU_ENV, **HOSTILE_VALUES}))
    return emulator


@pytest.fixture
def client(hostile_emulator: MetadataEmulator) -> Iterator[MetadataClient]:
    client = make_client(hostile_emulator, timeout=0.3)
    yield client
    client.close()


def test_sync_writes_both_files_root_only_writable_and_names_what_docker_cannot_carry(
    root: Root, hostile_emulator: MetadataEmulator, client: MetadataClient, caplog: pytest.LogCaptureFixture
) -> None:
    sync = EnvSync(root, make_config(hostile_emulator), client)
    with caplog.at_level(logging.WARNING, logger="tpuboot.env"):
        result = sync.sync_once(deadline_s=5)
    assert result.status == "tpu-env: 32 keys from metadata"
    wanted = parse_tpu_env(tpu_env_yaml({**SAMPLE_TPU_ENV, **HOSTILE_VALUES})).values
    assert systemd_load_env_file(root.path(SYSTEMD).read_bytes().decode()) == wanted
    assert docker_env_file(root.path(DOCKER).read_bytes().decode()) == {
        k: v for k, v in wanted.items() if k not in NEWLINE_KEYS
    }
    for path in (SYSTEMD, DOCKER):
        assert root.path(path).stat().st_mode & 0o777 == 0o644
    assert root.path("/run/tpuboot").stat().st_mode & 0o777 == 0o755
    (warning,) = [r for r in caplog.records if "left out of" in r.getMessage()]
    assert warning.getMessage().startswith(f"tpu-env: {', '.join(NEWLINE_KEYS)} left out of {DOCKER}: ")
    assert " ".join(NEWLINE_KEYS) == warning.TPU_ENV_SKIPPED  # type: ignore[attr-defined]

    inodes = [root.path(p).stat().st_ino for p in (SYSTEMD, DOCKER)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tpuboot.env"):
        sync.sync_once(deadline_s=5)
    assert [root.path(p).stat().st_ino for p in (SYSTEMD, DOCKER)] == inodes  # idempotent
    assert not [r for r in caplog.records if "left out of" in r.getMessage()]  # said once per value


def test_null_paths_write_nothing_and_a_failed_write_is_in_the_status(
    root: Root, hostile_emulator: MetadataEmulator, client: MetadataClient
) -> None:
    config = make_config(hostile_emulator, systemd_env_path=None, docker_env_path="/srv/blocked/env")
    root.path("/srv/blocked/env").mkdir(parents=True)
    root.path("/srv/blocked/env/x").write_text("")  # a non-empty directory where the file goes
    result = EnvSync(root, config, client).sync_once(deadline_s=5)
    assert result.source == "metadata" and result.tpu_env_written
    assert result.status.startswith("tpu-env: 32 keys from metadata; /srv/blocked/env not written: ")
    assert not root.path("/run/tpuboot").exists()


def test_the_paths_are_configurable_and_checked() -> None:
    config = parse_config("env: {systemd_env_path: null, docker_env_path: /etc/tpu.env}\n", "f")
    assert (config.env.systemd_env_path, config.env.docker_env_path) == (None, "/etc/tpu.env")
    with pytest.raises(ConfigError, match=r"^f: env.docker_env_path: 'tpu.env' is not an absolute path"):
        parse_config("env: {docker_env_path: tpu.env}\n", "f")
