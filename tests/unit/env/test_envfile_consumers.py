"""Each rendering of the tpu-env values read by its real consumer: systemd's own env-file parser
(libsystemd-shared's load_env_file, through ctypes), the docker CLI's ``--env-file`` reader (the
real CLI against a fake dockerd that records the container it is asked to create), dash sourcing
tpu-env, and /etc/environment by pam_env (libpam, a PAM service of the test's own) and by
systemd's parser again (Debian's systemd links it into environment.d, so user managers read it
with the same code).

Each consumer must take its file whole, and get every value byte for byte except those tpuboot
left out of that file, each named in one warning.
"""

from __future__ import annotations

import ctypes
import glob
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV, MetadataEmulator, tpu_env_yaml
from tests.unit.fakes.dockerd import FakeDockerd
from tests.unit.helpers.metadata import make_client, make_config
from tpuboot.env.etc_environment import ensure_environment
from tpuboot.env.sync import EnvSync
from tpuboot.env.tpuenv import (
    REFUSED_NAMES,
    SYSTEMD_REFUSED,
    parse_tpu_env,
    render_docker_env_file,
    render_env_file,
    render_systemd_env_file,
)
from tpuboot.paths import Root

SYSTEMD = "/run/tpuboot/tpu-env.env"
DOCKER = "/run/tpuboot/tpu-env.docker"
TPU_ENV = "/home/tpu-runtime/tpu-env"
#: Every code point systemd's utf8_is_valid refuses that a Python str may hold in UTF-8.
NONCHARACTERS = [chr(c) for c in [*range(0xFDD0, 0xFDF0), *(p << 16 | 0xFFFE for p in range(17))]] + [
    chr(p << 16 | 0xFFFF) for p in range(17)
]
IMAGE = "tpuboot-test/envdump:1"


# --- the consumers ---------------------------------------------------------------------------------


class Systemd:
    """systemd's env-file parser as EnvironmentFile= and environment.d use it (systemd 252:
    ``int load_env_file(FILE *f, const char *fname, char ***ret)``), and the executor's check that
    drops a single assignment (``bool env_assignment_is_valid(const char *e)``)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-*.so"))
        if not found:
            pytest.fail("libsystemd-shared not found: install Debian's systemd (scripts/host-packages.txt)")
        lib = ctypes.CDLL(found[-1])
        self._load = lib.load_env_file
        self._load.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.POINTER(ctypes.c_char_p)),
        ]
        self._load.restype = ctypes.c_int
        self._valid = lib.env_assignment_is_valid
        self._valid.argtypes = [ctypes.c_char_p]
        self._valid.restype = ctypes.c_bool
        self._free = lib.strv_free
        self._free.argtypes = [ctypes.c_void_p]
        self._free.restype = ctypes.c_void_p

    def load(self, path: Path, keys: set[str] | None = None) -> dict[str, str]:
        """What a unit gets from the file; fails the test when systemd refuses the file, or one of
        ``keys`` (None: every entry) that its executor would drop."""
        strv = ctypes.POINTER(ctypes.c_char_p)()
        code = self._load(None, os.fsencode(path), ctypes.byref(strv))
        assert code >= 0, f"systemd refused the whole of {path}: {os.strerror(-code)}"
        entries: list[bytes] = []
        try:
            while strv and strv[len(entries)] is not None:
                entries.append(strv[len(entries)])  # type: ignore[arg-type]
        finally:
            self._free(strv)
        found = dict(entry.decode("utf-8").split("=", 1) for entry in entries)
        checked = [e for e in entries if keys is None or e.decode("utf-8").split("=", 1)[0] in keys]
        assert all(self._valid(entry) for entry in checked), "the executor would drop an assignment"
        return found


@pytest.fixture(scope="module")
def systemd() -> Systemd:
    return Systemd()


class Docker:
    """The docker CLI's own --env-file reader: `docker create --env-file FILE` against a fake dockerd
    that records the Env the CLI sends."""

    def __init__(self, cli: str, workdir: Path) -> None:
        self.cli = cli
        self.workdir = workdir
        self.fake = FakeDockerd(workdir / "docker.sock").start()
        self.fake.images.update({IMAGE, f"docker.io/{IMAGE}"})

    def load(self, path: Path) -> dict[str, str]:
        before = len(self.fake.requests)
        name = f"envdump-{before}"  # the fake has one namespace of names, as dockerd does
        out = subprocess.run(
            [
                self.cli,
                "-H",
                f"unix://{self.fake.socket_path}",
                "create",
                "--name",
                name,
                "--env-file",
                str(path),
                IMAGE,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                "HOME": str(self.workdir),
                "DOCKER_CONFIG": str(self.workdir / "config"),
                "PATH": "/usr/bin:/bin",
            },
            check=False,
        )
        assert out.returncode == 0, f"docker refused {path}: {out.stderr.strip()}"
        (create,) = [r for r in self.fake.requests[before:] if r.path.endswith("/containers/create")]
        body = create.body if isinstance(create.body, dict) else json.loads(create.body)
        return dict(entry.split("=", 1) for entry in body["Env"] or [])


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    cli = shutil.which("docker")
    if cli is None:  # not in scripts/host-packages.txt: the VM test runs Debian's docker in the guest
        pytest.skip("no docker CLI on PATH; tests/vm/test_tpuboot_envfiles.py runs a real one in the guest")
    with tempfile.TemporaryDirectory() as workdir:
        engine = Docker(cli, Path(workdir))
        yield engine
        engine.fake.stop()


class PamEnv:
    """pam_env as a login reads /etc/environment (``readenv=1``), through libpam: a PAM service
    of its own in a directory of its own (``pam_start_confdir``, Linux-PAM 1.4 and later), so
    nothing of the host's PAM configuration or /etc/security/pam_env.conf takes part."""

    class _Conv(ctypes.Structure):
        _fields_ = [("conv", ctypes.c_void_p), ("appdata_ptr", ctypes.c_void_p)]

    def __init__(self, workdir: Path) -> None:
        try:
            self._pam = ctypes.CDLL("libpam.so.0")
        except OSError:
            pytest.fail("libpam not found: it comes with Debian's libpam0g, which systemd depends on")
        self._pam.pam_start_confdir.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.POINTER(PamEnv._Conv),
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        self._pam.pam_getenvlist.restype = ctypes.POINTER(ctypes.c_char_p)
        self._pam.pam_open_session.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._pam.pam_getenvlist.argtypes = [ctypes.c_void_p]
        self._pam.pam_end.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.confdir = workdir / "pam.d"
        self.confdir.mkdir()

    def load(self, path: Path) -> dict[str, str]:
        service = "tpuboot-test"
        (self.confdir / service).write_text(
            f"session required pam_env.so readenv=1 envfile={path} conffile=/dev/null user_readenv=0\n"
        )
        handle = ctypes.c_void_p()
        conv = PamEnv._Conv(None, None)
        code = self._pam.pam_start_confdir(
            service.encode(), b"root", ctypes.byref(conv), os.fsencode(self.confdir), ctypes.byref(handle)
        )
        assert code == 0, f"pam_start_confdir: {code}"
        try:
            assert self._pam.pam_open_session(handle, 0) == 0, f"pam_env refused {path}"
            entries = self._pam.pam_getenvlist(handle)
            out: list[bytes] = []
            while entries and entries[len(out)] is not None:
                out.append(entries[len(out)])  # type: ignore[arg-type]
        finally:
            self._pam.pam_end(handle, 0)
        return dict(entry.decode("utf-8").split("=", 1) for entry in out)  # type: ignore[misc]


@pytest.fixture(scope="module")
def pam_env(tmp_path_factory: pytest.TempPathFactory) -> PamEnv:
    return PamEnv(tmp_path_factory.mktemp("pam"))


def dash_sources(path: Path, keys: list[str]) -> dict[str, str]:
    """What the TPU runtime's ``set -a; . tpu-env`` gives each key, by dash."""
    script = '. "$1"; shift; for tpuboot_key_ do eval "printf %s\\\\\\\\0 \\"\\${$tpuboot_key_}\\""; done'
    out = subprocess.run(
        ["/bin/dash", "-c", script, "dash", str(path), *keys], capture_output=True, check=True, timeout=30
    )
    return dict(zip(keys, out.stdout.decode("utf-8").split("\0")[: len(keys)], strict=True))


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_bytes(text.encode("utf-8"))
    return path


# --- the class: a value one consumer refuses costs only that value, in that file -------------------


@pytest.mark.parametrize("char", NONCHARACTERS, ids=lambda c: f"U+{ord(c):04X}")
def test_each_noncharacter_is_left_out_of_the_systemd_file_only(
    systemd: Systemd, tmp_path: Path, char: str
) -> None:
    values = {"BEFORE": "a", "BAD": f"x{char}y", "AFTER": "b"}
    text, skipped = render_systemd_env_file(values)
    assert list(skipped) == ["BAD"] and f"U+{ord(char):04X}" in skipped["BAD"]
    assert systemd.load(write(tmp_path, "env", text)) == {"BEFORE": "a", "AFTER": "b"}
    # Without tpuboot's check, systemd would have refused the whole file: the test can fail.
    with pytest.raises(AssertionError, match="refused the whole"):
        systemd.load(write(tmp_path, "raw", render_env_file(values)))
    assert dash_sources(write(tmp_path, "sh", render_env_file(values)), list(values)) == values


def test_the_refused_set_is_what_systemd_refuses(systemd: Systemd, tmp_path: Path) -> None:
    """Every assigned code point below U+30000 and each plane's last two: systemd refuses exactly
    those SYSTEMD_REFUSED names."""
    points = [*range(0x20, 0xD800), *range(0xE000, 0x30000), *(p << 16 | 0xFFFD for p in range(3, 17))]
    points += [p << 16 | low for p in range(3, 17) for low in (0xFFFE, 0xFFFF)]
    chunk = 4096
    for start in range(0, len(points), chunk):
        values = {f"V{c:X}": chr(c) for c in points[start : start + chunk] if chr(c) not in '"\\`$'}
        text, skipped = render_systemd_env_file(values)
        assert systemd.load(write(tmp_path, "env", text)) == {
            k: v for k, v in values.items() if k not in skipped
        }
        for key in skipped:  # each one alone is refused by systemd itself
            with pytest.raises(AssertionError, match="refused the whole"):
                systemd.load(write(tmp_path, "one", render_env_file({key: values[key]})))
    assert not SYSTEMD_REFUSED.search("".join(chr(c) for c in range(0x20, 0xD800)))


def test_docker_carries_noncharacters_and_leaves_out_what_it_would_misread(
    docker: Docker, tmp_path: Path
) -> None:
    values = {
        **SAMPLE_TPU_ENV,
        **HOSTILE_VALUES,
        "NONCHAR": "a\ufffeb\U0010ffff",
        "DQ_WRAPPED": '"x"',
        "SQ_WRAPPED": "'x'",
        "EMPTY_QUOTES": '""',
        "ONE_QUOTE": '"',
        "HALF": '"x',
        "MIXED": "\"x'",
        "INNER": 'a"b"c',
        "LEADING_BLANK": " \tx",
        "ENDS_CR": "x\r",
        "MID_CR": "a\rb",
    }
    text, skipped = render_docker_env_file(values)
    assert {"DQ_WRAPPED", "SQ_WRAPPED", "EMPTY_QUOTES", "ENDS_CR"} <= set(skipped)
    assert not {"NONCHAR", "ONE_QUOTE", "HALF", "MIXED", "INNER", "LEADING_BLANK", "MID_CR"} & set(skipped)
    assert "6805" in skipped["DQ_WRAPPED"]
    assert docker.load(write(tmp_path, "env", text)) == {k: v for k, v in values.items() if k not in skipped}


def test_the_quoted_value_docker_leaves_out_reaches_systemd_and_sh(systemd: Systemd, tmp_path: Path) -> None:
    values = {"DQ": '"x"', "SQ": "'x'"}
    text, skipped = render_systemd_env_file(values)
    assert not skipped and systemd.load(write(tmp_path, "env", text)) == values
    assert dash_sources(write(tmp_path, "sh", render_env_file(values)), list(values)) == values


# Text as tpu-env accepts it, weighted to what the readers treat specially, noncharacters included.
VALUES = st.text(
    st.one_of(
        st.sampled_from(
            list(" \t\n\r\"'\\$`#;=") + NONCHARACTERS[:4] + ["\ufffd", "\u2028", "\x85", "\ufeff"]
        ),
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
    ),
    max_size=16,
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(lambda n: n not in REFUSED_NAMES)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(NAMES, VALUES, max_size=6))
def test_generated_values_reach_systemd_and_sh_whole(
    systemd: Systemd, tmp_path: Path, values: dict[str, str]
) -> None:
    text, skipped = render_systemd_env_file(values)
    assert systemd.load(write(tmp_path, "env", text)) == {k: v for k, v in values.items() if k not in skipped}
    assert all(SYSTEMD_REFUSED.search(values[k]) for k in skipped)
    assert dash_sources(write(tmp_path, "sh", render_env_file(values)), list(values)) == values


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(NAMES, VALUES, max_size=6))
def test_generated_values_reach_docker_whole(docker: Docker, tmp_path: Path, values: dict[str, str]) -> None:
    text, skipped = render_docker_env_file(values)
    assert docker.load(write(tmp_path, "env", text)) == {k: v for k, v in values.items() if k not in skipped}


# --- as EnvSync writes them, with one warning per file ---------------------------------------------


SYNCED = {**SAMPLE_TPU_ENV, "NONCHAR": "a\ufdd0b", "PLANE": "\U0001fffe", "WRAPPED": '"x"'}


@pytest.fixture
def noncharacter_emulator(emulator: MetadataEmulator) -> MetadataEmulator:
    emulator.set_attribute("tpu-env", tpu_env_yaml(SYNCED))
    return emulator


def test_sync_writes_every_file_its_consumer_takes_whole_and_names_each_left_out_value(
    root: Root, noncharacter_emulator: MetadataEmulator, systemd: Systemd, caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(noncharacter_emulator, timeout=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="tpuboot.env"):
            result = EnvSync(root, make_config(noncharacter_emulator), client).sync_once(deadline_s=5)
    finally:
        client.close()
    assert result.source == "metadata"
    wanted = parse_tpu_env(tpu_env_yaml(SYNCED)).values
    assert systemd.load(root.path(SYSTEMD)) == {
        k: v for k, v in wanted.items() if k not in ("NONCHAR", "PLANE")
    }
    assert dash_sources(root.path(TPU_ENV), list(wanted)) == wanted
    warnings = [r.getMessage() for r in caplog.records if "left out of" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"tpu-env: NONCHAR, PLANE left out of {SYSTEMD}: NONCHAR holds U+FDD0")
    assert warnings[1].startswith(
        f"tpu-env: WRAPPED left out of {DOCKER}: WRAPPED is wrapped in matching quotes"
    )


def test_etc_environment_leaves_out_what_pam_env_or_systemd_would_misread_and_keeps_the_rest(
    root: Root, systemd: Systemd, pam_env: PamEnv, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wanted: Mapping[str, str] = {
        "GOOD": "1",
        "BAD": "x\uffffy",
        "QUOTE": 'a"b',
        "HASH": "it's #1",
        "ALSO": "two words",
    }
    with caplog.at_level(logging.WARNING, logger="tpuboot.env.etc_environment"):
        written = ensure_environment(root, "/etc/environment", wanted)
    assert set(written) == {"GOOD", "ALSO"}
    for consumer in (systemd, pam_env):
        assert consumer.load(root.path("/etc/environment")) == {"GOOD": "1", "ALSO": "two words"}
    (warning,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warning.startswith("/etc/environment: left out BAD, QUOTE, HASH: ") and "U+FFFF" in warning
    # What they would have made of the lines as tpuboot wrote them before: pam_env cuts at the #,
    # systemd refuses the whole file.
    assert pam_env.load(write(tmp_path, "hash", 'HASH="it\'s #1"\n')) == {"HASH": "it's "}
    with pytest.raises(AssertionError, match="refused the whole"):
        systemd.load(write(tmp_path, "nonchar", 'GOOD=1\nBAD="x\uffffy"\n'))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    wanted=st.dictionaries(NAMES, VALUES, max_size=5),
    admin=st.sampled_from(["", "A=admin\n# c\nexport B=1\n"]),
)
def test_generated_etc_environment_reaches_pam_env_and_systemd_whole(
    pam_env: PamEnv,
    systemd: Systemd,
    tmp_path_factory: pytest.TempPathFactory,
    wanted: dict[str, str],
    admin: str,
) -> None:
    root = Root(tmp_path_factory.mktemp("etc"))
    root.path("/etc").mkdir()
    root.path("/etc/environment").write_text(admin)
    written = ensure_environment(root, "/etc/environment", wanted)
    expected = {
        **dict(
            line.removeprefix("export ").split("=", 1)
            for line in admin.splitlines()
            if "=" in line and not line.startswith("#")
        )
    }
    expected.update({k: wanted[k] for k in written})
    assert pam_env.load(root.path("/etc/environment")) == expected
    mine = systemd.load(root.path("/etc/environment"), set(written))  # admin lines are the admin's
    assert {k: mine.get(k) for k in written} == {k: wanted[k] for k in written}
