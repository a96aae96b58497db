"""The Debian package and the files it ships: built once (scripts/build-deb, about 10 s), then
checked with lintian, dpkg-deb and systemd-analyze; its maintainer scripts run against a
temporary root through dpkg's DPKG_ROOT (no chroot, nothing outside the root touched).

Tests that need the build skip where the Debian build tools are missing
(scripts/host-packages.txt lists them); the rest run anywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import tpuboot
from tpuboot import config as config_module
from tpuboot.config import Config, parse_config
from tpuboot.imagecheck import run_checks
from tpuboot.paths import Root

TOP = Path(__file__).resolve().parents[2]
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_TOOLS = ("dpkg-buildpackage", "dh", "dh_python3", "lintian", "dpkg-deb")

HAVE_BUILD_TOOLS = all(shutil.which(tool, path=SYSTEM_PATH) for tool in BUILD_TOOLS)
needs_build_tools = pytest.mark.skipif(
    not HAVE_BUILD_TOOLS,
    reason="Debian build tools missing: apt-get install the build packages in scripts/host-packages.txt",
)
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze", path=SYSTEM_PATH) is None,
    reason="systemd-analyze missing (package systemd)",
)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = kwargs.pop("env", None) or {**os.environ, "PATH": SYSTEM_PATH}
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=120, **kwargs)  # type: ignore[call-overload]


# --- The package, built once ---------------------------------------------------------------------

BUILD_LEFTOVERS = (
    "debian/tpuboot",
    "debian/.debhelper",
    "debian/files",
    ".pybuild",
    "build",
    "tpuboot.egg-info",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of scripts/build-deb --source (the .deb, .dsc, .changes ...)."""
    if not HAVE_BUILD_TOOLS:
        pytest.skip("Debian build tools missing")
    before = {path for path in BUILD_LEFTOVERS if (TOP / path).exists()}
    out = tmp_path_factory.mktemp("deb")
    done = run([str(TOP / "scripts/build-deb"), "--source", str(out)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out / f"tpuboot_{tpuboot.__version__}_all.deb")
    # The build ran in a copy: it left nothing behind in the work tree.
    assert {path for path in BUILD_LEFTOVERS if (TOP / path).exists()} == before
    return out


@pytest.fixture(scope="module")
def deb(built: Path) -> Path:
    return built / f"tpuboot_{tpuboot.__version__}_all.deb"


@pytest.fixture(scope="module")
def contents(deb: Path) -> dict[str, str]:
    """Path (without the leading '.') -> mode string, from dpkg-deb -c."""
    listing = run(["dpkg-deb", "-c", str(deb)])
    assert listing.returncode == 0, listing.stderr
    files = {}
    for line in listing.stdout.splitlines():
        fields = line.split()
        files[fields[5].lstrip(".").rstrip("/") or "/"] = fields[0]
    return files


def extract(deb: Path, root: Path) -> Path:
    """The package's files and its control scripts (in root/DEBIAN) under ``root``."""
    for argv in (["dpkg-deb", "-x", str(deb), str(root)], ["dpkg-deb", "-e", str(deb), str(root / "DEBIAN")]):
        done = run(argv)
        assert done.returncode == 0, done.stderr
    return root


@needs_build_tools
def test_lintian_is_clean(built):
    changes = next(built.glob("*.changes"))
    done = run(["lintian", "--fail-on", "error,warning", "--display-info", str(changes)])
    complaints = [line for line in done.stdout.splitlines() if re.match(r"[EWI]: ", line)]
    assert (done.returncode, complaints) == (0, []), done.stdout + done.stderr


EXPECTED_FILES = {
    "/usr/bin/tpuboot": "-rwxr-xr-x",
    "/usr/lib/python3/dist-packages/tpuboot/__init__.py": "-rw-r--r--",
    "/usr/lib/python3/dist-packages/tpuboot/cli.py": "-rw-r--r--",
    "/usr/lib/python3/dist-packages/tpuboot/imagecheck.py": "-rw-r--r--",
    "/lib/systemd/system/tpuboot.service": "-rw-r--r--",
    "/usr/lib/tmpfiles.d/tpuboot.conf": "-rw-r--r--",
    "/lib/udev/rules.d/70-tpuboot.rules": "-rw-r--r--",
    "/etc/tpuboot/tpuboot.yaml": "-rw-r--r--",
    "/etc/security/limits.d/tpuboot.conf": "-rw-r--r--",
    "/etc/default/grub.d/tpuboot.cfg": "-rw-r--r--",
    "/usr/lib/systemd/system.conf.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/lib/systemd/system/docker.service.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/lib/systemd/system/containerd.service.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/share/man/man8/tpuboot.8.gz": "-rw-r--r--",
    "/usr/share/doc/tpuboot/copyright": "-rw-r--r--",
}


@needs_build_tools
def test_deb_ships_every_file(contents):
    assert {path: contents.get(path) for path in EXPECTED_FILES} == EXPECTED_FILES
    # Every module of the source package is installed, and nothing outside the expected trees.
    modules = {p.name for p in (TOP / "tpuboot").glob("*.py")}
    shipped = {Path(p).name for p in contents if p.startswith("/usr/lib/python3/dist-packages/tpuboot/")}
    assert modules <= shipped
    allowed = (
        "/etc/",
        "/lib/systemd/",
        "/lib/udev/",
        "/usr/bin/",
        "/usr/lib/",
        "/usr/share/doc/",
        "/usr/share/lintian/overrides/",
        "/usr/share/man/",
    )
    stray = [p for p, mode in contents.items() if not mode.startswith("d") and not p.startswith(allowed)]
    assert stray == []


@needs_build_tools
def test_deb_control_conffiles_and_depends(deb):
    conffiles = run(["dpkg-deb", "-I", str(deb), "conffiles"]).stdout.split()
    assert sorted(conffiles) == [
        "/etc/default/grub.d/tpuboot.cfg",
        "/etc/security/limits.d/tpuboot.conf",
        "/etc/tpuboot/tpuboot.yaml",
    ]
    fields = run(["dpkg-deb", "-f", str(deb), "Architecture", "Depends", "Version"]).stdout
    control = dict(line.split(": ", 1) for line in fields.splitlines())
    assert control["Architecture"] == "all"
    assert control["Version"] == tpuboot.__version__
    depends = {re.sub(r"[ :(].*", "", dep.strip()) for dep in control["Depends"].split(",")}
    wanted = {"kmod", "python3", "python3-pyudev", "python3-yaml", "python3-requests", "python3-systemd"}
    assert wanted | {"python3-prometheus-client"} <= depends
    assert "python3-docker" not in depends  # tpuboot.dockerapi speaks the Engine API itself


@needs_build_tools
@needs_systemd_analyze
def test_installed_unit_verifies_clean(deb, tmp_path):
    root = extract(deb, tmp_path / "root")
    env = {**os.environ, "PATH": SYSTEM_PATH, "MANPATH": str(root / "usr/share/man")}
    done = run(["systemd-analyze", "verify", f"--root={root}", "tpuboot.service"], env=env)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@needs_build_tools
def test_shipped_settings_pass_image_check(deb, tmp_path):
    """Installed settings + the kernel command line the GRUB drop-in makes = every check PASSes."""
    root = extract(deb, tmp_path / "root")
    cmdline = grub_cmdline(root / "etc/default/grub.d/tpuboot.cfg", "console=ttyS0", arch="amd64")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/cmdline").write_text(f"BOOT_IMAGE=/vmlinuz root=UUID=1 ro {cmdline}\n")
    (root / "proc/sys/kernel/arch").write_text("x86_64\n")
    (root / "sys/kernel/mm/transparent_hugepage").mkdir(parents=True)
    (root / "sys/kernel/mm/transparent_hugepage/enabled").write_text("[always] madvise never\n")
    for unit in ("docker.service", "containerd.service"):  # as Debian's docker.io and containerd ship them
        (root / "lib/systemd/system" / unit).write_text(
            "[Service]\nExecStart=/usr/bin/true\nLimitNPROC=infinity\n"
        )
    results = run_checks(Root(root))
    assert [(r.name, r.status) for r in results if r.status != "PASS"] == []


# --- Maintainer scripts, run against a temporary root --------------------------------------------

STUBBED = ("py3compile", "py3clean", "update-grub", "udevadm", "systemctl", "deb-systemd-invoke")


@pytest.fixture
def installed(deb: Path, tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """(root, environment, call log): the package unpacked under root; its scripts run with
    DPKG_ROOT=root. Commands that would act on the host are stubs logging to the call log;
    deb-systemd-helper and systemd-tmpfiles are the real ones (both honour DPKG_ROOT)."""
    root = extract(deb, tmp_path / "root")
    stubs, log = tmp_path / "stubs", tmp_path / "calls.log"
    stubs.mkdir()
    log.touch()
    for name in STUBBED:
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        stub.chmod(0o755)
    env = {"PATH": f"{stubs}:{SYSTEM_PATH}", "DPKG_ROOT": str(root), "DPKG_MAINTSCRIPT_PACKAGE": "tpuboot"}
    yield root, env, log


def maintscript(root: Path, env: dict[str, str], script: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = run(["sh", str(root / "DEBIAN" / script), *args], env={**env, "DPKG_MAINTSCRIPT_NAME": script})
    assert done.returncode == 0, f"{script} {' '.join(args)}: {done.stderr}"
    return done


@needs_build_tools
def test_maintainer_scripts_are_posix_sh(deb, tmp_path):
    root = extract(deb, tmp_path / "root")
    dash = shutil.which("dash", path=SYSTEM_PATH) or "sh"
    for script in ("postinst", "postrm", "prerm"):
        text = (root / "DEBIAN" / script).read_text()
        assert text.startswith("#!/bin/sh\n")
        done = run([dash, "-n", str(root / "DEBIAN" / script)])
        assert done.returncode == 0, done.stderr


@needs_build_tools
def test_install_enables_the_unit_and_purge_removes_everything(installed):
    root, env, log = installed
    wants = root / "etc/systemd/system/multi-user.target.wants/tpuboot.service"

    done = maintscript(root, env, "postinst", "configure", "")
    assert wants.is_symlink() and os.readlink(wants) == "/lib/systemd/system/tpuboot.service"
    assert (root / "home/tpu-runtime").is_dir()  # tmpfiles.d, before tpuboot.service ever runs
    assert "run update-grub inside" in done.stderr  # never the host's GRUB under DPKG_ROOT
    calls = log.read_text()
    assert "py3compile -p tpuboot" in calls
    assert "update-grub" not in calls and "udevadm" not in calls

    maintscript(root, env, "postinst", "configure", "0.0.1")  # an upgrade: idempotent
    assert wants.is_symlink()

    # What the daemon leaves at run time.
    (root / "var/lib/tpuboot").mkdir(parents=True)
    (root / "var/lib/tpuboot/tpu-env.json").write_text("{}")
    (root / "home/tpu-runtime/tpu-env").write_text('ZONE="z"\n')

    maintscript(root, env, "prerm", "remove")
    maintscript(root, env, "postrm", "remove")
    assert (root / "var/lib/tpuboot/tpu-env.json").exists()  # remove keeps state; purge does not
    for conffile in (root / "DEBIAN/conffiles").read_text().split():
        (root / conffile.lstrip("/")).unlink()  # dpkg deletes conffiles before postrm purge
    done = maintscript(root, env, "postrm", "purge")
    assert not (root / "var/lib/tpuboot").exists()
    assert not (root / "home/tpu-runtime").exists()
    assert not wants.is_symlink()
    assert not (root / "var/lib/systemd/deb-systemd-helper-enabled/tpuboot.service.dsh-also").exists()
    assert "drop its kernel command line" in done.stderr


@needs_build_tools
def test_purge_removes_the_environment_lines_tpuboot_wrote_and_only_those(installed):
    root, env, _log = installed
    maintscript(root, env, "postinst", "configure", "")
    (root / "var/lib/tpuboot").mkdir(parents=True)
    (root / "var/lib/tpuboot/environment.lines").write_text('GCS_A=300\nGCS_B="x y"\nGCS_C=1\n')
    environment = root / "etc/environment"
    environment.write_text('PATH="/usr/bin"\nGCS_A=300\nGCS_B="x y"\n# GCS_C=1\nGCS_C=2\nGCS_A=3000\n')
    environment.chmod(0o640)
    maintscript(root, env, "postrm", "purge")
    # Ours as written: gone. The admin's edit of one, a comment, a longer line: kept.
    assert environment.read_text() == 'PATH="/usr/bin"\n# GCS_C=1\nGCS_C=2\nGCS_A=3000\n'
    assert environment.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in (root / "etc").iterdir() if "tpuboot-purge" in p.name) == []


@needs_build_tools
def test_purge_keeps_a_home_directory_with_other_files(installed):
    root, env, _log = installed
    maintscript(root, env, "postinst", "configure", "")
    (root / "home/tpu-runtime/tpu-env").write_text("")
    (root / "home/tpu-runtime/notes.txt").write_text("mine")
    maintscript(root, env, "postrm", "purge")
    assert sorted(p.name for p in (root / "home/tpu-runtime").iterdir()) == ["notes.txt"]


@needs_build_tools
def test_maintainer_scripts_refuse_unknown_actions(installed):
    root, env, _log = installed
    for script in ("postinst", "postrm"):
        done = run(["sh", str(root / "DEBIAN" / script), "bogus"], env=env)
        assert done.returncode == 1 and "unknown argument 'bogus'" in done.stderr


# --- The files themselves (no build needed) -------------------------------------------------------


def grub_cmdline(dropin: Path, before: str, arch: str, extra: str = "") -> str:
    """GRUB_CMDLINE_LINUX after grub-mkconfig's way of sourcing ``dropin`` (as dash, set -e)."""
    script = (
        f'dpkg() {{ echo {arch}; }}\nGRUB_CMDLINE_LINUX="{before}"\nGRUB_CMDLINE_LINUX_DEFAULT="quiet"\n'
        f'. "{dropin}"\n{extra}'
        'echo "$GRUB_CMDLINE_LINUX|$GRUB_CMDLINE_LINUX_DEFAULT"\n'
        "if command -v tpuboot_cmdline_add >/dev/null; then echo leaked >&2; exit 1; fi\n"
    )
    done = run(["sh", "-e", "-c", script])
    assert done.returncode == 0, done.stderr
    cmdline, default = done.stdout.strip().split("|")
    assert default == "quiet"
    return cmdline


GRUB_DROPIN = TOP / "conf/grub.d/tpuboot.cfg"


@pytest.mark.parametrize(
    ("before", "arch", "after"),
    [
        ("", "amd64", "idle=poll transparent_hugepage=always intel_iommu=on,sm_on"),
        ("", "arm64", "idle=poll transparent_hugepage=always"),
        (
            "console=ttyS0,38400n8",
            "amd64",
            "console=ttyS0,38400n8 idle=poll transparent_hugepage=always intel_iommu=on,sm_on",
        ),
        # The admin's explicit choice wins; nothing is duplicated.
        (
            "transparent_hugepage=madvise idle=poll",
            "amd64",
            "transparent_hugepage=madvise idle=poll intel_iommu=on,sm_on",
        ),
        ("intel_iommu=off", "amd64", "intel_iommu=off idle=poll transparent_hugepage=always"),
    ],
)
def test_grub_dropin_appends_without_clobbering(before, arch, after):
    assert grub_cmdline(GRUB_DROPIN, before, arch) == after


def test_grub_dropin_sourced_twice_adds_nothing_more():
    once = grub_cmdline(GRUB_DROPIN, "quiet", "amd64")
    assert grub_cmdline(GRUB_DROPIN, "quiet", "amd64", extra=f'. "{GRUB_DROPIN}"\n') == once


def test_default_config_lists_every_key_commented_with_its_default():
    text = (TOP / "conf/tpuboot.yaml").read_text()
    assert parse_config(text, "tpuboot.yaml") == Config()  # all commented out
    uncommented = "\n".join(re.sub(r"^(\s*)#(?=\S)", r"\1", line) for line in text.splitlines())
    assert parse_config(uncommented, "tpuboot.yaml") == Config()  # and each shown value is the default
    sections = {
        "vfio": config_module.VfioConfig,
        "metadata": config_module.MetadataConfig,
        "env": config_module.EnvConfig,
    }
    for section, cls in sections.items():
        assert re.search(rf"^#{section}:$", text, re.MULTILINE), section
        for name in cls.options:
            match = re.search(rf"^  # (.+)\n  #{name}:", text, re.MULTILINE)
            assert match, f"{section}.{name} is not listed with a line of explanation"
    assert re.search(r"^#devices: \[\]$", text, re.MULTILINE)


def test_changelog_and_man_page_carry_the_package_version():
    first = (TOP / "debian/changelog").read_text().splitlines()[0]
    assert first.startswith(f"tpuboot ({tpuboot.__version__}) ")
    assert f'"tpuboot {tpuboot.__version__}"' in (TOP / "doc/tpuboot.8").read_text().splitlines()[1]


@needs_systemd_analyze
def test_unit_verifies_clean(tmp_path):
    """The unit as written, against a root holding a stand-in /usr/bin/tpuboot and the man page."""
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tpuboot").write_text("#!/bin/sh\n")
    (root / "usr/bin/tpuboot").chmod(0o755)
    (root / "lib/systemd/system").mkdir(parents=True)
    shutil.copy(TOP / "systemd/tpuboot.service", root / "lib/systemd/system/")
    (root / "man/man8").mkdir(parents=True)
    shutil.copy(TOP / "doc/tpuboot.8", root / "man/man8/")
    env = {**os.environ, "PATH": SYSTEM_PATH, "MANPATH": str(root / "man")}
    done = run(["systemd-analyze", "verify", f"--root={root}", "tpuboot.service"], env=env)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@needs_systemd_analyze
def test_unit_exposure_stays_low():
    """systemd-analyze security, offline. 2.6 on Debian 12's systemd 252: root, CAP_SYS_MODULE,
    network and /dev access are what tpuboot's job needs; anything more is a regression."""
    done = run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(TOP / "systemd/tpuboot.service")]
    )
    match = re.search(r"Overall exposure level for tpuboot.service: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    assert float(match.group(1)) <= 2.6


@needs_systemd_analyze
@pytest.mark.parametrize("unit", ["docker.service", "containerd.service"])
def test_runtime_dropins_verify_clean(tmp_path, unit):
    root = tmp_path / "root"
    (root / "lib/systemd/system").mkdir(parents=True)
    (root / "lib/systemd/system" / unit).write_text(
        "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=/bin/sh\n"
    )
    (root / "bin").mkdir()
    (root / "bin/sh").write_text("")
    (root / "bin/sh").chmod(0o755)
    dropins = root / "usr/lib/systemd/system" / f"{unit}.d"
    dropins.mkdir(parents=True)
    shutil.copy(TOP / "conf/systemd" / f"{unit}.d" / "50-tpuboot.conf", dropins)
    done = run(["systemd-analyze", "verify", f"--root={root}", unit])
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_udev_rule_gives_accel_0666_and_leaves_vfio_to_tpuboot():
    rules = [
        line
        for line in (TOP / "udev/tpuboot.rules").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules == ['KERNEL=="accel*", MODE="0666"']
