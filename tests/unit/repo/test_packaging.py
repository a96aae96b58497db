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
from tpuboot.checks.image import run_checks
from tpuboot.containers.cdi import SPEC_PATH as CDI_SPEC_PATH
from tpuboot.containers.engine import MANAGED_LABEL
from tpuboot.paths import Root

pytestmark = pytest.mark.packaging

TOP = Path(__file__).resolve().parents[3]
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
    "/usr/lib/python3/dist-packages/tpuboot/checks/image.py": "-rw-r--r--",
    "/lib/systemd/system/tpuboot.service": "-rw-r--r--",
    "/usr/lib/tmpfiles.d/tpuboot.conf": "-rw-r--r--",
    "/lib/udev/rules.d/70-tpuboot.rules": "-rw-r--r--",
    "/etc/tpuboot/tpuboot.yaml": "-rw-r--r--",
    "/etc/tpuboot/maintenance.d": "drwxr-xr-x",  # the notice hooks' (doc/notices.md), empty
    "/etc/security/limits.d/tpuboot.conf": "-rw-r--r--",
    "/etc/default/grub.d/tpuboot.cfg": "-rw-r--r--",
    "/usr/lib/systemd/system.conf.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/lib/systemd/system/docker.service.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/lib/systemd/system/containerd.service.d/50-tpuboot.conf": "-rw-r--r--",
    "/usr/share/man/man8/tpuboot.8.gz": "-rw-r--r--",
    "/usr/share/tpuboot/prometheus/tpuboot.rules.yml": "-rw-r--r--",
    "/usr/share/tpuboot/node-problem-detector/tpu-conditions.json": "-rw-r--r--",
    "/usr/share/tpuboot/node-problem-detector/tpu-events.json": "-rw-r--r--",
    "/usr/share/doc/tpuboot/copyright": "-rw-r--r--",
    # Named from setup.cfg's metadata: a build that missed it would ship UNKNOWN-0.0.0.dist-info.
    f"/usr/lib/python3/dist-packages/tpuboot-{tpuboot.__version__}.dist-info/METADATA": "-rw-r--r--",
    f"/usr/lib/python3/dist-packages/tpuboot-{tpuboot.__version__}.dist-info/entry_points.txt": "-rw-r--r--",
}


@needs_build_tools
def test_deb_ships_every_file(contents):
    assert {path: contents.get(path) for path in EXPECTED_FILES} == EXPECTED_FILES
    # Every module of the source package is installed, and nothing outside the expected trees.
    package = "/usr/lib/python3/dist-packages/tpuboot/"
    modules = {p.relative_to(TOP / "tpuboot").as_posix() for p in (TOP / "tpuboot").rglob("*.py")}
    shipped = {p.removeprefix(package) for p in contents if p.startswith(package)}
    assert modules <= shipped
    assert {"devices/vfio.py", "env/sync.py", "containers/service.py", "checks/doctor.py"} <= modules
    allowed = (
        "/etc/",
        "/lib/systemd/",
        "/lib/udev/",
        "/usr/bin/",
        "/usr/lib/",
        "/usr/share/doc/",
        "/usr/share/lintian/overrides/",
        "/usr/share/man/",
        "/usr/share/tpuboot/",
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
    assert "python3-docker" not in depends  # tpuboot.containers.dockerapi speaks the Engine API itself


# --- Depends against the four systems' versions -------------------------------------------------

# The versions each system ships of every package the .deb depends on: shared notes,
# platforms.md (the distributions' package pages, late 2026; release pocket, the lowest). Upstream
# versions without the Debian revision, which can only make a check stricter (5.4.1 sorts before
# 5.4.1-1ubuntu1). kmod is not in platforms.md: Debian 12's is the host's (dpkg -s kmod), the
# others are recalled from the distributions' package pages, which are not reachable from here;
# only its presence matters while tpuboot's relation on it is unversioned. python3-grpcio (the
# Recommends) from platforms.md; Debian 13's recalled, as kmod's.
PLATFORMS: dict[str, dict[str, str]] = {
    "Ubuntu 22.04": {
        "python3": "3.10.6",
        "python3-yaml": "5.4.1",
        "python3-requests": "2.25.1",
        "python3-pyudev": "0.22.0",
        "python3-systemd": "234",
        "python3-prometheus-client": "0.9.0",
        "python3-grpcio": "1.30.2",
        "kmod": "29",
    },
    "Ubuntu 24.04": {
        "python3": "3.12.3",
        "python3-yaml": "6.0.1",
        "python3-requests": "2.31.0",
        "python3-pyudev": "0.24.0",
        "python3-systemd": "235",
        "python3-prometheus-client": "0.19.0",
        "python3-grpcio": "1.51.1",
        "kmod": "31+20240202",
    },
    "Debian 12": {
        "python3": "3.11.2",
        "python3-yaml": "6.0",
        "python3-requests": "2.28.1",
        "python3-pyudev": "0.24.0",
        "python3-systemd": "235",
        "python3-prometheus-client": "0.16.0",
        "python3-grpcio": "1.51.1",
        "kmod": "30+20221128",
    },
    "Debian 13": {
        "python3": "3.13.5",
        "python3-yaml": "6.0.2",
        "python3-requests": "2.32.3",
        "python3-pyudev": "0.24.3",
        "python3-systemd": "235",
        "python3-prometheus-client": "0.21.1",
        "python3-grpcio": "1.51.1",
        "kmod": "34.2",
    },
}

RELATION = re.compile(
    r"(?P<name>[a-z0-9][a-z0-9+.-]+)(?::(?P<arch>[a-z0-9-]+))?"
    r"(?:\s*\(\s*(?P<op><<|<=|=|>=|>>)\s*(?P<version>[^)\s]+)\s*\))?"
)


def parse_relations(field: str) -> list[list[tuple[str, str | None, str | None]]]:
    """A Depends-style field as [[(name, op, version), ...alternatives], ...]. The architecture
    qualifier (python3:any) names the same package, for an arch-all one."""
    relations = []
    for relation in field.split(","):
        alternatives = []
        for alternative in relation.split("|"):
            match = RELATION.fullmatch(alternative.strip())
            assert match, f"cannot parse relation {alternative.strip()!r} in {field!r}"
            assert match["arch"] in (None, "any", "native"), alternative
            alternatives.append((match["name"], match["op"], match["version"]))
        relations.append(alternatives)
    return relations


def dpkg_compare(have: str, op: str, want: str) -> bool:
    """Debian's version ordering (~ before anything, 0.9 < 0.10), from dpkg itself."""
    return run(["dpkg", "--compare-versions", have, op, want]).returncode == 0


def unsatisfied(field: str, versions: dict[str, str]) -> list[str]:
    """The relations of ``field`` that no alternative satisfies with ``versions``."""
    missing = []
    for alternatives in parse_relations(field):
        if not any(
            name in versions and (op is None or dpkg_compare(versions[name], op, str(version)))
            for name, op, version in alternatives
        ):
            missing.append(" | ".join(f"{n} ({o} {v})" if o else n for n, o, v in alternatives))
    return missing


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg", path=SYSTEM_PATH) is None, reason="dpkg missing")


@needs_dpkg
@pytest.mark.parametrize(
    ("field", "missing"),
    [
        ("python3:any (>= 3.10~), kmod", []),
        ("python3:any (>= 3.11~)", ["python3 (>= 3.11~)"]),  # a newer Python than 22.04's
        ("python3-prometheus-client (>= 0.10)", ["python3-prometheus-client (>= 0.10)"]),  # 0.9.0 < 0.10
        ("python3-yaml (>= 5.4.1-1)", ["python3-yaml (>= 5.4.1-1)"]),  # a revision: stricter, never looser
        ("python3-docker", ["python3-docker"]),  # a package the table does not list
        ("python3-docker | python3-requests (>= 2.25)", []),
        ("python3-systemd (<< 235)", []),
    ],
)
def test_relation_check_uses_debian_ordering(field, missing):
    assert unsatisfied(field, PLATFORMS["Ubuntu 22.04"]) == missing


@needs_build_tools
@pytest.mark.parametrize("system", sorted(PLATFORMS))
def test_deb_depends_are_satisfiable_on(deb, system):
    """Every relation the built package carries, ${python3:Depends} and ${misc:Depends} expanded
    (python3:any, and (>= 3.x~) where dh-python adds one), against that system's versions."""
    names = ("Pre-Depends", "Depends", "Recommends")
    fields = run(["dpkg-deb", "-f", str(deb), *names]).stdout
    control = dict(line.split(": ", 1) for line in fields.splitlines())
    assert "Depends" in control
    problems = {name: unsatisfied(value, PLATFORMS[system]) for name, value in control.items()}
    assert {name: missing for name, missing in problems.items() if missing} == {}


@needs_dpkg
def test_control_depends_floors_are_ubuntu_2204s():
    """debian/control's Depends as written, without a build: satisfiable everywhere too."""
    binary = (TOP / "debian/control").read_text().split("\nPackage: tpuboot\n")[1]
    depends = re.search(r"^Depends:(.*?)(?=^\S)", binary, re.MULTILINE | re.DOTALL)
    assert depends
    field = ",".join(
        part
        for part in re.sub(r"#.*", "", depends.group(1)).replace("\n", " ").split(",")
        if part.strip() and not part.strip().startswith("${")
    )
    for system, versions in PLATFORMS.items():
        assert unsatisfied(field, versions) == [], system


# --- Building on Ubuntu 22.04's toolchain ----------------------------------------------------------

# Ubuntu 22.04's build tools (platforms.md) and what each provides.
UBUNTU_2204_BUILD_TOOLS = {
    "debhelper": "13.6",
    "debhelper-compat": "13",  # Provides: debhelper-compat (= 7 ... 13) in 13.6
    "dh-python": "5.20220403",
    "dh-sequence-python3": "5.20220403",  # Provided by dh-python
    "pybuild-plugin-pyproject": "5.20220403",  # universe
    "python3-all": "3.10.6",
    "python3-setuptools": "59.6.0",
    "python3-wheel": "0.37.1",
}

# What the source package has debhelper do, and the debhelper release that brought each, read in
# debhelper's own source (tags 4.2.5 to 13.6; 4.2.5 is its oldest tag): all at or before 13.6.
# dh runs dh_installtmpfiles from compat 13 and dh_installsystemd from compat 11 (root_sequence.pm).
DEBHELPER_FEATURES = {
    "compat 13": "13",
    "dh_install (debian/tpuboot.install)": "4.2.5",
    "dh_installdirs (debian/tpuboot.dirs)": "4.2.5",
    "dh_installman (debian/tpuboot.manpages)": "4.2.5",
    "dh_installdeb (debian/tpuboot.postinst, .postrm)": "4.2.5",
    "dh_lintian (debian/tpuboot.lintian-overrides)": "6.0.7",
    "dh_installudev (debian/tpuboot.udev), --priority": "5.0.24",
    "dh_installsystemd (debian/tpuboot.service)": "10.9.2",
    "dh_installtmpfiles (debian/tpuboot.tmpfiles)": "12.8",
}
DEBIAN_FILE_HELPERS = {
    "install": "dh_install",
    "dirs": "dh_installdirs",
    "manpages": "dh_installman",
    "postinst": "dh_installdeb",
    "postrm": "dh_installdeb",
    "lintian-overrides": "dh_lintian",
    "udev": "dh_installudev",
    "service": "dh_installsystemd",
    "tmpfiles": "dh_installtmpfiles",
}


@needs_dpkg
def test_build_depends_are_satisfiable_with_ubuntu_2204s_tools():
    control = (TOP / "debian/control").read_text().split("\n\n")[0]
    build_depends = re.search(r"^Build-Depends:(.*?)(?=^\S)", control, re.MULTILINE | re.DOTALL)
    assert build_depends
    field = ",".join(p for p in build_depends.group(1).replace("\n", " ").split(",") if p.strip())
    assert unsatisfied(field, UBUNTU_2204_BUILD_TOOLS) == []


@needs_dpkg
def test_debhelper_features_exist_in_ubuntu_2204s_debhelper():
    assert not (TOP / "debian/compat").exists()  # the level is debhelper-compat (= 13) in Build-Depends
    assert "debhelper-compat (= 13)" in (TOP / "debian/control").read_text()
    # Every per-package file in debian/ is one a helper in the table reads.
    kinds = {p.name.removeprefix("tpuboot.") for p in (TOP / "debian").glob("tpuboot.*")}
    assert kinds <= DEBIAN_FILE_HELPERS.keys(), "a debian/tpuboot.* file no helper in the table reads"
    used = {DEBIAN_FILE_HELPERS[kind] for kind in kinds}
    # And every debhelper command debian/rules calls itself.
    used |= set(re.findall(r"^\t(dh_[a-z0-9_]+)", (TOP / "debian/rules").read_text(), re.MULTILINE))
    listed = {feature.split()[0] for feature in DEBHELPER_FEATURES}
    assert used <= listed
    newer = {f: v for f, v in DEBHELPER_FEATURES.items() if not dpkg_compare(v, "<=", "13.6")}
    assert newer == {}


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
    modules = root / "lib/modules/6.8.0-1015-gcp"  # Ubuntu's linux-gcp kernel: vfio-pci built in
    modules.mkdir(parents=True)
    (modules / "modules.builtin").write_text("kernel/drivers/vfio/pci/vfio-pci.ko\n")
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
    spec = root / CDI_SPEC_PATH.replace("/var/run/", "run/", 1)  # a daemon killed before its stop
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text("{}")
    other = spec.parent / "nvidia.com-gpu.json"  # another CDI writer's, in the shared directory
    other.write_text("{}")

    maintscript(root, env, "prerm", "remove")
    maintscript(root, env, "postrm", "remove")
    assert (root / "var/lib/tpuboot/tpu-env.json").exists()  # remove keeps state; purge does not
    for conffile in (root / "DEBIAN/conffiles").read_text().split():
        (root / conffile.lstrip("/")).unlink()  # dpkg deletes conffiles before postrm purge
    done = maintscript(root, env, "postrm", "purge")
    assert not (root / "var/lib/tpuboot").exists()
    assert not (root / "home/tpu-runtime").exists()
    assert not spec.exists() and other.exists()
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
def test_purge_removes_each_recorded_line_once_and_never_an_admins(installed):
    """Before: the postrm deleted every line equal to a recorded one (the admin's repeat of it, a
    continuation of the admin's line), and a blank record line emptied the file."""
    root, env, _log = installed
    maintscript(root, env, "postinst", "configure", "")
    (root / "var/lib/tpuboot").mkdir(parents=True)
    (root / "var/lib/tpuboot/environment.lines").write_text("GCS_A=300\n\nGCS_B=1\nGCS_C=2\n")
    environment = root / "etc/environment"
    admins = b"OPTS=a \\\nGCS_A=300\nGCS_C=2\r\nGCS_A=300\nGCS_B=1\n\nGCS_B=1"  # no final newline
    environment.write_bytes(b"GCS_A=300\n" + admins)
    maintscript(root, env, "postrm", "purge")
    # GCS_A: the first standalone line went; the continuation and the admin's repeat stayed.
    # GCS_B: the first went, the admin's repeat stayed. GCS_C: only a CRLF line, not as written.
    assert environment.read_bytes() == b"OPTS=a \\\nGCS_A=300\nGCS_C=2\r\nGCS_A=300\n\nGCS_B=1"


@needs_build_tools
def test_purge_keeps_a_home_directory_with_other_files(installed):
    root, env, _log = installed
    maintscript(root, env, "postinst", "configure", "")
    (root / "home/tpu-runtime/tpu-env").write_text("")
    (root / "home/tpu-runtime/notes.txt").write_text("mine")
    maintscript(root, env, "postrm", "purge")
    assert sorted(p.name for p in (root / "home/tpu-runtime").iterdir()) == ["notes.txt"]


@needs_build_tools
def test_purge_leaves_a_users_home_and_files_that_are_not_tpuboots(installed):
    """/home/tpu-runtime may be a user's home (tmpfiles leaves an existing one as it is)."""
    root, env, _log = installed
    maintscript(root, env, "postinst", "configure", "")
    home = root / "home/tpu-runtime"
    (home / "tpu-env").write_text('ZONE="z"\n')  # tpuboot's: root's, regular
    os.chown(home, 1000, 1000)
    maintscript(root, env, "postrm", "purge")
    assert home.is_dir() and list(home.iterdir()) == []  # tpuboot's file gone, the user's home kept
    (home / "tpu-env").write_text("mine")
    os.chown(home / "tpu-env", 1000, 1000)
    maintscript(root, env, "postrm", "purge")
    assert (home / "tpu-env").read_text() == "mine"


@needs_build_tools
def test_postinst_warns_of_the_documented_procedures_leftovers(installed, tmp_path):
    """The image's own tpuboot (run by the host's python3 under DPKG_ROOT) names each leftover and
    its fix on stderr; the install succeeds all the same and leaves no byte-code behind."""
    root, env, _log = installed
    rules = root / "etc/udev/rules.d"
    rules.mkdir(parents=True)
    (rules / "99-tpu-vfiopci.rules").write_text(
        'SUBSYSTEM=="pci", ATTRS{vendor}=="0x1ae0", TAG+="bind_to_vfio_pci"\n'
        'TAG=="bind_to_vfio_pci", RUN+="/lib/udev/bind_to_vfio_pci.sh $kernel"\n'
    )
    (root / "etc/environment").write_text("GCS_RESOLVE_REFRESH_SECS=60\nGCS_RESOLVE_REFRESH_SECS=60\n")
    done = maintscript(root, env, "postinst", "configure", "")
    lines = [line for line in done.stderr.splitlines() if "leftover-" in line]
    assert [line.split()[:3] for line in lines] == [
        ["tpuboot:", "FAIL", "leftover-vfio-binder:"],
        ["tpuboot:", "WARN", "leftover-environment-duplicates:"],
    ]
    assert "fix: remove /etc/udev/rules.d/99-tpu-vfiopci.rules" in lines[0]
    assert "tpuboot binds TPUs itself" in lines[0]
    assert not list((root / "usr/lib/python3/dist-packages").rglob("__pycache__"))


@needs_build_tools
def test_postinst_says_nothing_of_leftovers_on_a_clean_image(installed):
    root, env, _log = installed
    (root / "etc/environment").write_text("GCS_RESOLVE_REFRESH_SECS=60\n")
    done = maintscript(root, env, "postinst", "configure", "")
    assert "leftover-" not in done.stderr


@needs_build_tools
def test_postinst_leftover_scan_never_fails_the_install(installed, tmp_path):
    """A python3 that cannot run tpuboot (here: one that fails) changes nothing: exit 0."""
    root, env, log = installed
    stubs = Path(env["PATH"].split(":")[0])
    (stubs / "python3").write_text(f'#!/bin/sh\necho "python3 $*" >> {log}\nexit 1\n')
    (stubs / "python3").chmod(0o755)
    done = maintscript(root, env, "postinst", "configure", "")
    assert "image-check --only leftover-*" in log.read_text()
    assert "leftover-" not in done.stderr


# A docker CLI standing in for the real one (tests/vm has the real dockerd): `ps` prints the names
# in $FAKE_DOCKER_PS and exits $FAKE_DOCKER_STATUS (0 by default); every call is logged.
FAKE_DOCKER = """#!/bin/sh
echo "docker $*" >> "$CALLS"
case "$1" in
ps) [ -z "${FAKE_DOCKER_PS:-}" ] || printf '%s\n' $FAKE_DOCKER_PS ;;
esac
exit "${FAKE_DOCKER_STATUS:-0}"
"""


@pytest.fixture
def live(deb: Path, tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], Path]]:
    """(root, environment, call log) to run the package's scripts as on a live VM, without
    DPKG_ROOT: every command they would run on this host is a logging stub (ischroot says "not a
    chroot"), and docker is FAKE_DOCKER."""
    root = extract(deb, tmp_path / "root")
    stubs, log = tmp_path / "stubs", tmp_path / "calls.log"
    stubs.mkdir()
    log.touch()
    for name in (*STUBBED, "deb-systemd-helper", "ischroot"):
        status = 1 if name == "ischroot" else 0
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit {status}\n')
        (stubs / name).chmod(0o755)
    (stubs / "docker").write_text(FAKE_DOCKER)
    (stubs / "docker").chmod(0o755)
    env = {"PATH": f"{stubs}:{SYSTEM_PATH}", "CALLS": str(log), "DPKG_MAINTSCRIPT_PACKAGE": "tpuboot"}
    yield root, env, log


def docker_calls(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("docker ")]


def test_postrm_removes_the_containers_labelled_as_tpuboots():
    """The label the postrm selects is the one tpuboot/containers/engine.py puts on its containers."""
    postrm = (TOP / "debian/tpuboot.postrm").read_text()
    assert f"TPUBOOT_LABEL={MANAGED_LABEL}=1\n" in postrm


@needs_build_tools
def test_remove_stops_and_removes_tpuboots_containers_and_keeps_images(live):
    root, env, log = live
    names = "tpuboot-vbar-control-agent tpuboot-ai-telemetry-collector"
    done = maintscript(root, {**env, "FAKE_DOCKER_PS": names}, "postrm", "remove")
    assert docker_calls(log) == [
        f"docker ps -a --filter label={MANAGED_LABEL}=1 --format {{{{.Names}}}}",
        f"docker rm -f {names}",
    ]  # no rmi, no image prune
    assert f"removed its containers: {names} (their images stay" in done.stderr


@needs_build_tools
def test_remove_without_containers_or_in_a_chroot_or_on_upgrade_removes_nothing(live):
    root, env, log = live
    maintscript(root, env, "postrm", "remove")  # none running
    assert [c.split()[1] for c in docker_calls(log)] == ["ps"]
    log.write_text("")
    for action in ("upgrade", "purge"):
        maintscript(root, {**env, "FAKE_DOCKER_PS": "tpuboot-vbar-control-agent"}, "postrm", action, "0.2")
    assert docker_calls(log) == []
    (Path(env["PATH"].split(":")[0]) / "ischroot").write_text("#!/bin/sh\nexit 0\n")  # a chroot
    maintscript(root, {**env, "FAKE_DOCKER_PS": "tpuboot-vbar-control-agent"}, "postrm", "remove")
    assert docker_calls(log) == []


@needs_build_tools
def test_remove_with_dockerd_not_answering_still_succeeds(live):
    root, env, log = live
    done = maintscript(root, {**env, "FAKE_DOCKER_STATUS": "1", "FAKE_DOCKER_PS": "x"}, "postrm", "remove")
    assert [c.split()[1] for c in docker_calls(log)] == ["ps"]
    if Path("/run/docker.sock").is_socket():
        assert "xargs -r docker rm -f" in done.stderr


@needs_build_tools
def test_maintainer_scripts_refuse_unknown_actions(installed):
    root, env, _log = installed
    for script in ("postinst", "postrm"):
        done = run(["sh", str(root / "DEBIAN" / script), "bogus"], env=env)
        assert done.returncode == 1 and "unknown argument 'bogus'" in done.stderr


# --- The files themselves (no build needed) -------------------------------------------------------


def grub_cmdline(dropin: Path, before: str, arch: str, extra: str = "", default: str = "quiet") -> str:
    """GRUB_CMDLINE_LINUX after grub-mkconfig's way of sourcing ``dropin`` (as dash, set -e);
    GRUB_CMDLINE_LINUX_DEFAULT is ``default`` before and must be left as it was."""
    script = (
        f'dpkg() {{ echo {arch}; }}\nGRUB_CMDLINE_LINUX="{before}"\nGRUB_CMDLINE_LINUX_DEFAULT="{default}"\n'
        f'. "{dropin}"\n{extra}'
        'echo "$GRUB_CMDLINE_LINUX|$GRUB_CMDLINE_LINUX_DEFAULT"\n'
        "if command -v tpuboot_cmdline_add >/dev/null; then echo leaked >&2; exit 1; fi\n"
    )
    done = run(["sh", "-e", "-c", script])
    assert done.returncode == 0, done.stderr
    cmdline, after_default = done.stdout.strip().split("|")
    assert after_default == default
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


def test_grub_dropin_adds_nothing_already_in_the_default_line():
    """Ubuntu's cloud images set GRUB_CMDLINE_LINUX_DEFAULT in grub.d; some images append there."""
    default = "console=tty1 console=ttyS0 intel_iommu=on,sm_on"
    assert grub_cmdline(GRUB_DROPIN, "", "amd64", default=default) == "idle=poll transparent_hugepage=always"


def test_grub_dropin_sourced_twice_adds_nothing_more():
    once = grub_cmdline(GRUB_DROPIN, "quiet", "amd64")
    assert grub_cmdline(GRUB_DROPIN, "quiet", "amd64", extra=f'. "{GRUB_DROPIN}"\n') == once


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
    """systemd-analyze security, offline. 3.1 on Debian 12's systemd 252: root, CAP_SYS_MODULE,
    CAP_DAC_OVERRIDE (tpu-env in a user's /home/tpu-runtime), CAP_SYS_PTRACE (who holds a chip:
    0.3 of it), network and /dev access are what tpuboot's job needs; anything more is a
    regression."""
    done = run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(TOP / "systemd/tpuboot.service")]
    )
    match = re.search(r"Overall exposure level for tpuboot.service: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    assert float(match.group(1)) <= 3.1


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
