"""Odd values never crash a command: every number tpuboot reads from sysfs, from its own state
files and from the files its checks judge is read as the kernel (or tpuboot) writes it, ASCII
digits of bounded length (:mod:`tpuboot.numbers`). Whatever else stands there (a superscript,
Arabic-Indic digits, a sign, a blank, an underscore, nothing, a mebibyte of digits, bytes that are
not UTF-8) is "not known": the command prints its result, or its one-line error, and never a
traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tpuboot import cli
from tpuboot.devices.table import GOOGLE

A = "0000:00:04.0"
DEVICE = f"/sys/bus/pci/devices/{A}"
#: What a file may hold instead of the kernel's digits.
ODD: dict[str, bytes] = {
    "superscript": "²".encode(),
    "arabic-indic": "١٢".encode(),
    "plus": b"+1",
    "blank": b" 1",
    "underscore": b"1_0",
    "empty": b"",
    "too-large-for-a-float": b"9" * 400,
    "mebibyte": b"9" * (1 << 20),
    "not-utf8": b"\xff\xfe1",
}
#: Each sysfs reader: the file, and its content around the odd value.
SYSFS = {
    "current_link_speed": b"%s GT/s PCIe\n",
    "max_link_speed": b"%s GT/s PCIe\n",
    "current_link_width": b"%s\n",
    "max_link_width": b"%s\n",
    "aer_dev_fatal": b"DLP %s\nTOTAL_ERR_FATAL %s\n",
    "aer_dev_nonfatal": b"Undefined %s\nTOTAL_ERR_NONFATAL %s\n",
    "aer_dev_correctable": b"RxErr %s\nTOTAL_ERR_COR %s\n",
    "uevent": b"PCI_ID=1AE0:%s\nPCI_SUBSYS_ID=1AE0:00AD\n",
    "reset_method": b"%s\n",
    "driver_override": b"%s\n",
}


def tpu(tmp_path: Path) -> FakeKernel:
    """One v5p chip, bound, its link and AER counters as the kernel writes them."""
    kernel = FakeKernel(tmp_path)
    kernel.load_module("vfio-pci")
    kernel.add_device(A, GOOGLE, 0x0062, (GOOGLE, 0x00AD), driver="vfio-pci", group="4")
    kernel.p("/dev/vfio/4").chmod(0o666)
    d = kernel.p(DEVICE)
    for name, text in (("current_link_speed", "16.0 GT/s PCIe"), ("current_link_width", "16")):
        (d / name).write_text(text + "\n")
        (d / name.replace("current", "max")).write_text(text + "\n")
    (d / "aer_dev_fatal").write_text("DLP 0\nTOTAL_ERR_FATAL 0\n")
    (d / "reset").touch()
    (d / "reset_method").write_text("flr\n")
    return kernel


def run(kernel: FakeKernel, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command on the tree: its exit status and output; stderr is one line or none."""
    code = cli.main(["--root", str(kernel.top), *args])
    out, err = capsys.readouterr()
    assert code in (cli.EXIT_OK, cli.EXIT_FAILED), err
    assert err.count("\n") <= 1 and (err == "" or err.startswith("tpuboot: ")), err[:300]
    return code, out, err


@pytest.mark.parametrize("odd", ODD, ids=list(ODD))
@pytest.mark.parametrize("name", SYSFS, ids=list(SYSFS))
def test_sysfs_numbers_that_are_not_the_kernels_are_unknown(tmp_path, capsys, name, odd):
    kernel = tpu(tmp_path)
    template = SYSFS[name]
    (kernel.p(DEVICE) / name).write_bytes(template.replace(b"%s", ODD[odd]))
    _, out, _ = run(kernel, capsys, "status")
    if name == "uevent":  # its ids unreadable: not a TPU, and nothing to reset
        assert out == "no TPUs found\n"
        _, _, err = run(kernel, capsys, "reset", "--dry-run", A)
        assert "is not a TPU" in err
        return
    (line,) = [line for line in out.splitlines() if line.startswith(A)]
    if "link" in name:
        shown = "? x16" if "speed" in name else "GT/s x?"
        assert shown in line and "! " not in line  # an unknown link is not judged
    if name.startswith("aer_"):
        assert "PCIe error" not in line  # a count that is no count is no error
    run(kernel, capsys, "status", "--json")
    run(kernel, capsys, "reset", "--dry-run", A)


@pytest.mark.parametrize("odd", ODD, ids=list(ODD))
def test_aer_baselines_that_are_not_counts_are_forgotten(tmp_path, capsys, odd):
    """tpuboot's own record of the counts at a reset: a value that is not a count (raw in the JSON,
    or as a string) counts as no baseline, and the fatal error since boot is shown."""
    kernel = tpu(tmp_path)
    (kernel.p(DEVICE) / "aer_dev_fatal").write_text("DLP 1\nTOTAL_ERR_FATAL 1\n")
    path = kernel.p("/run/tpuboot/aer-baseline.json")
    path.parent.mkdir(parents=True)
    raw = [] if odd == "blank" else [ODD[odd]]  # " 1" is 1 in JSON, as tpuboot may have written it
    for value in (*raw, b'"' + ODD[odd] + b'"', b"1e400", b"NaN", b"-1", b"9" * 400, b"[" * 100_000):
        path.write_bytes(b'{"%s": {"fatal": %s}}' % (A.encode(), value))
        _, out, _ = run(kernel, capsys, "status")
        assert "logged 1 fatal PCIe error(s) since boot" in out


@pytest.mark.parametrize("odd", ODD, ids=list(ODD))
def test_numbers_in_the_files_doctor_judges_are_unknown_or_refused(tmp_path, capsys, odd):
    """The limits files (PAM's memlock, systemd's DefaultLimitMEMLOCK=), /proc/stat's btime and the
    tpu-env cache, each holding the odd value at once: doctor gives its verdicts."""
    kernel = tpu(tmp_path)
    value = ODD[odd]
    files = {
        "/etc/security/limits.conf": b"* - memlock %s\n",
        "/etc/systemd/system.conf.d/limits.conf": b"[Manager]\nDefaultLimitMEMLOCK=%s\n",
        "/proc/stat": b"cpu  1 2 3 4\nbtime %s\n",
        "/var/lib/tpuboot/tpu-env.json": b'{"format": 2, "fetched": "x", "tpu_env": "A: 1", "etag": %s}',
    }
    for path, template in files.items():
        kernel.p(path).parent.mkdir(parents=True, exist_ok=True)
        kernel.p(path).write_bytes(template.replace(b"%s", value))
    _, out, _ = run(kernel, capsys, "doctor")
    for check, unknown in (
        ("pam-memlock", "PAM memlock: * not set;"),
        ("systemd-default-limits", "is unreadable"),
    ):
        (line,) = [line for line in out.splitlines() if line.startswith(f"FAIL  {check}: ")]
        if odd == "blank":  # both files separate fields by blanks: " 1" is 1 there, as PAM reads it
            assert "memlock 1 (" in line or "* 1 (" in line
        elif odd in ("mebibyte", "not-utf8"):  # the file itself is refused, in the check's line
            assert "cannot read" in line
        elif odd == "empty" and check == "systemd-default-limits":  # an empty setting resets it
            assert "memlock systemd's built-in default" in line
        else:  # the value is skipped, as pam_limits skips it, or said to be unreadable
            assert unknown in line
    run(kernel, capsys, "image-check")


@pytest.mark.parametrize(
    ("reader", "text", "value"),
    [
        ("hex", "0x1ae0", None),  # sysfs's vendor file has it; tpuboot reads uevent's PCI_ID
        ("hex", "1AE0", 0x1AE0),
        ("hex", "0x", None),
        ("hex", "+1ae0", None),
        ("hex", " 1ae0", None),
        ("hex", "1_ae0", None),
        ("hex", "١٢", None),
        ("hex", "f" * 17, None),
        ("hex", b"\xff", None),
        ("signed", "-1", -1),
        ("signed", "137", 137),
        ("signed", "--1", None),
        ("signed", "+1", None),
        ("signed", "-²", None),
        ("decimal", "8.0", 8.0),
        ("decimal", "2.5", 2.5),
        ("decimal", "16", 16.0),
        ("decimal", "nan", None),
        ("decimal", "inf", None),
        ("decimal", "1e3", None),
        ("decimal", "8.", None),
        ("decimal", ".5", None),
        ("decimal", "١٢", None),
        ("decimal", "9" * 400, None),
    ],
)
def test_the_readers_beside_ascii_int_take_the_kernels_formats_only(reader, text, value):
    from tpuboot.numbers import ascii_decimal, ascii_hex, ascii_signed

    read = {"hex": ascii_hex, "signed": ascii_signed, "decimal": ascii_decimal}[reader]
    assert read(text) == value


def test_a_tpu_env_cache_nested_deep_is_no_record():
    from tpuboot.env.cache import parse_record

    assert parse_record(b"[" * 100_000) is None
    assert parse_record(b'{"format": 2, "fetched": "x", "tpu_env": "A: 1", "etag": null}') is not None


@pytest.mark.parametrize("version", ["Docker version ²⁶.1", "podman version ١٢.٣", "v" + "9" * 400 + ".1"])
def test_an_engine_version_that_is_not_ascii_digits_is_unknown(version):
    from tpuboot.checks.cdi import parse_version

    assert parse_version(version) is None
    assert parse_version("Docker version 26.1.5+dfsg1") == (26, 1)


class Shown:
    """A Systemd that answers as `systemctl show` would, with ``MainPID`` as given."""

    def __init__(self, main: str) -> None:
        self.main = main

    def live(self, root: object) -> bool:
        return True

    def show(self, unit: object, properties: object) -> dict[str, str]:
        return {"MainPID": self.main}


@pytest.mark.parametrize("odd", ODD, ids=list(ODD))
def test_a_main_pid_that_is_not_ascii_digits_is_none(tmp_path, odd):
    """systemd's MainPID and a cgroup's cgroup.procs (the --root tree's): a word that is no PID
    is passed over."""
    from tpuboot.checks.holders import main_pid
    from tpuboot.paths import Root

    text = ODD[odd].decode("utf-8", "replace")
    assert main_pid(Root(tmp_path), "job.service", Shown(text)) is None  # type: ignore[arg-type]
    assert main_pid(Root(tmp_path), "job.service", Shown("4242")) == 4242  # type: ignore[arg-type]
