"""The wheel's metadata, built the way each system's pybuild builds it.

setup.cfg is tpuboot's one source of package metadata because Ubuntu 22.04's setuptools (59.6)
cannot read PEP 621's [project] table: from that, it builds a wheel named UNKNOWN with no
dependencies and no `tpuboot` command. These tests build the wheel with 59.6 (and the build
front end and wheel of Ubuntu 22.04) in a venv made with Debian's /usr/bin/python3, with Debian
13's setuptools 78.1.1 in another, and with the host's own setuptools, and check every build
gives the same, right metadata and no deprecation warning.

The command mirrors the pyproject plugin of Ubuntu 22.04's dh-python (5.20220403,
dhpython/build/plugin_pyproject.py): in the source directory,
``python3 -m build --skip-dependency-check --no-isolation --wheel --outdir DIR``; then the wheel
is unpacked with ``installer`` into a scheme (scripts into scripts-X.Y), which is where the
/usr/bin/tpuboot wrapper comes from.

The venvs are kept in .cache/wheel-toolchains/ (about 10 s each to make, from PyPI, once).
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shutil
import subprocess
import sys
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest

import tpuboot

pytestmark = pytest.mark.packaging

TOP = Path(__file__).resolve().parents[3]
DEBIAN_PYTHON = "/usr/bin/python3"
CACHE = TOP / ".cache" / "wheel-toolchains"

# Each system's Python build tools, as PyPI has the same upstream releases. Ubuntu 22.04:
# python3-setuptools 59.6.0 (shared notes, platforms.md), and the build front end, wheel and
# installer of that release (python3-build 0.7.0, python3-wheel 0.37.1, python3-installer 0.5.0)
# with the dependencies build 0.7.0 needs, at Ubuntu 22.04's versions too; all pinned and
# installed without resolution, so the venv holds exactly these. Debian 13: setuptools 78.1.1
# (platforms.md), with a build front end and wheel of that time.
TOOLCHAINS: dict[str, tuple[tuple[str, ...], bool]] = {
    # name: (requirements, resolve their dependencies)
    "ubuntu-22.04": (
        (
            "setuptools==59.6.0",
            "wheel==0.37.1",
            "build==0.7.0",
            "pep517==0.12.0",
            "packaging==21.3",
            "pyparsing==2.4.7",
            "tomli==1.2.2",
            "installer==0.5.0",
        ),
        False,
    ),
    "debian-13": (("setuptools==78.1.1", "wheel==0.46.1", "build==1.2.2.post1", "installer==0.7.0"), True),
}

# Ubuntu 22.04's versions of the run-time dependencies (platforms.md): the floors in setup.cfg
# and debian/control may not be higher, or apt on Ubuntu 22.04 refuses the package.
JAMMY = {
    "PyYAML": "5.4.1",
    "prometheus-client": "0.9.0",
    "pyudev": "0.22.0",
    "requests": "2.25.1",
    "systemd-python": "234",
}
DEBIAN_NAMES = {
    "PyYAML": "python3-yaml",
    "prometheus-client": "python3-prometheus-client",
    "pyudev": "python3-pyudev",
    "requests": "python3-requests",
    "systemd-python": "python3-systemd",
    "grpcio": "python3-grpcio",
}
#: The optional dependency (extras ``runtime-metrics``; the .deb's Recommends): jammy's floor.
OPTIONAL = {"grpcio": "1.30"}


def clean_env(home: Path) -> dict[str, str]:
    """No venv, PYTHONPATH or user site of the caller's leaks into a build."""
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(home),
        "LC_ALL": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        **{k: v for k, v in os.environ.items() if k.startswith("PIP_")},
    }


def toolchain(name: str, tmp: Path) -> Path:
    """The Python of a cached venv holding ``TOOLCHAINS[name]``, made on first use. Keyed by
    the requirements, so changing a pin makes a new venv; made aside and renamed into place, so
    an interrupted run leaves no half-made venv behind."""
    requirements, resolve = TOOLCHAINS[name]
    key = hashlib.sha256("\n".join((DEBIAN_PYTHON, *requirements, str(resolve))).encode()).hexdigest()[:12]
    venv = CACHE / f"{name}-{key}"
    if not (venv / "bin/python").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = CACHE / f".{venv.name}.{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        env = clean_env(tmp)
        made = subprocess.run(
            [DEBIAN_PYTHON, "-m", "venv", str(partial)], capture_output=True, text=True, env=env, check=False
        )
        assert made.returncode == 0, made.stderr
        pip = [str(partial / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        pip += [] if resolve else ["--no-deps"]
        done = subprocess.run(
            [*pip, *requirements], capture_output=True, text=True, env=env, check=False, timeout=600
        )
        assert done.returncode == 0, f"pip install {' '.join(requirements)} (needs PyPI):\n{done.stderr}"
        try:
            partial.rename(venv)
        except OSError:  # another run made it meanwhile
            shutil.rmtree(partial, ignore_errors=True)
    return venv / "bin/python"


def source_copy(dest: Path) -> Path:
    """The files git knows, as in the work tree (what scripts/build-deb builds from)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=TOP,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = TOP / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def pybuild_wheel(python: str, tmp: Path) -> tuple[Path, str]:
    """(wheel, build output) from ``python -m build`` as dh-python's pyproject plugin runs it."""
    src = source_copy(tmp / "src")
    home, out = tmp / "home", tmp / "out"
    home.mkdir()
    done = subprocess.run(
        [python, "-m", "build", "--skip-dependency-check", "--no-isolation", "--wheel", "--outdir", str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        env=clean_env(home),
        check=False,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    wheels = list(out.glob("*.whl"))
    assert [w.name for w in wheels] == [f"tpuboot-{tpuboot.__version__}-py3-none-any.whl"], output
    return wheels[0], output


def read_dist_info(wheel: Path, name: str) -> str:
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"tpuboot-{tpuboot.__version__}.dist-info/{name}").decode()


def warnings_in(output: str) -> list[str]:
    """Warning lines of a build: SetuptoolsDeprecationWarning (78) or UserWarning (59-66) about
    setup.cfg, such as "Usage of dash-separated 'long-description' will not be supported"."""
    return [line for line in output.splitlines() if re.search(r"warn|deprecat", line, re.IGNORECASE)]


def requirement(line: str) -> str:
    """One Requires-Dist in one spelling: setuptools 59 writes ``PyYAML (>=5.4.1)`` and
    ``; extra == 'test'``, 78 writes ``PyYAML>=5.4.1`` and ``; extra == "test"``."""
    return re.sub(r"[\s()]", "", line).replace("'", '"')


def essentials(metadata: Message) -> dict[str, object]:
    """The METADATA fields tpuboot sets (setuptools 59 also writes Home-page/Platform UNKNOWN)."""
    return {
        "Name": metadata["Name"],
        "Version": metadata["Version"],
        "Summary": metadata["Summary"],
        "License": metadata["License"],
        "Requires-Python": metadata["Requires-Python"],
        "Description-Content-Type": metadata["Description-Content-Type"],
        "Requires-Dist": sorted(requirement(r) for r in metadata.get_all("Requires-Dist") or []),
        "Provides-Extra": sorted(metadata.get_all("Provides-Extra") or []),
        "Description": (metadata.get_payload() or metadata["Description"] or "").strip(),
    }


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def check_metadata(wheel: Path) -> dict[str, object]:
    metadata = Parser().parsestr(read_dist_info(wheel, "METADATA"))
    fields = essentials(metadata)
    assert fields["Name"] == "tpuboot"
    assert fields["Version"] == tpuboot.__version__
    assert fields["Requires-Python"] == ">=3.10"
    assert fields["Description"] == (TOP / "README.md").read_text().strip()
    floors = {}
    for line in fields["Requires-Dist"]:  # type: ignore[union-attr]
        if "extra==" in line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", line)
        assert match, f"run-time requirement without a plain floor: {line}"
        floors[match.group(1)] = match.group(2)
    assert floors.keys() == JAMMY.keys(), "a new run-time dependency: add it, with each system's version"
    too_high = {n: f for n, f in floors.items() if version_tuple(f) > version_tuple(JAMMY[n])}
    assert too_high == {}, "floors above Ubuntu 22.04's versions"

    entry_points = configparser.ConfigParser()
    entry_points.read_string(read_dist_info(wheel, "entry_points.txt"))
    assert {s: dict(entry_points[s]) for s in entry_points.sections()} == {
        "console_scripts": {"tpuboot": "tpuboot.cli:main"}
    }
    return fields


@pytest.fixture(scope="module")
def host_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel from the host's own setuptools, as the .deb is built (scripts/build-deb)."""
    has_build = subprocess.run(
        [DEBIAN_PYTHON, "-c", "import build, setuptools"], capture_output=True, check=False
    )
    if has_build.returncode != 0:
        pytest.skip("Debian's python3-build missing (package pybuild-plugin-pyproject pulls it in)")
    return pybuild_wheel(DEBIAN_PYTHON, tmp_path_factory.mktemp("host"))


def pinned_build(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp(name)
    return pybuild_wheel(str(toolchain(name, tmp)), tmp)


@pytest.fixture(scope="module")
def ubuntu_2204_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return pinned_build("ubuntu-22.04", tmp_path_factory)


@pytest.fixture(scope="module")
def debian_13_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return pinned_build("debian-13", tmp_path_factory)


def test_host_setuptools_builds_the_metadata(host_build):
    wheel, output = host_build
    check_metadata(wheel)
    assert warnings_in(output) == [], output


@pytest.mark.parametrize("build", ["ubuntu_2204_build", "debian_13_build"])
def test_each_systems_setuptools_builds_the_same_metadata(request, build, host_build):
    wheel, output = request.getfixturevalue(build)
    assert check_metadata(wheel) == check_metadata(host_build[0])
    # Each warns of what later ones refuse (dash-separated setup.cfg keys ...).
    assert warnings_in(output) == [], output


def test_ubuntu_2204_pybuild_unpacks_a_tpuboot_command(ubuntu_2204_build, tmp_path):
    """The second half of dh-python 5.20220403's pyproject plugin: the wheel unpacked with
    installer 0.5.0 into pybuild's build directory gives the modules and scripts-X.Y/tpuboot."""
    wheel, _ = ubuntu_2204_build
    python = toolchain("ubuntu-22.04", tmp_path)
    build_dir = tmp_path / "build"
    scripts = build_dir / f"scripts-{sys.version_info.major}.{sys.version_info.minor}"
    unpack = (
        "import sys\n"
        "from installer import install\n"
        "from installer.destinations import SchemeDictionaryDestination\n"
        "from installer.sources import WheelFile\n"
        "build, scripts, wheel = sys.argv[1:]\n"
        "scheme = {'platlib': build, 'purelib': build, 'scripts': scripts, 'data': build}\n"
        "destination = SchemeDictionaryDestination(\n"
        "    scheme, interpreter='/usr/bin/python3', script_kind='posix')\n"
        "with WheelFile.open(wheel) as source:\n"
        "    install(source=source, destination=destination, additional_metadata={})\n"
    )
    done = subprocess.run(
        [str(python), "-c", unpack, str(build_dir), str(scripts), str(wheel)],
        capture_output=True,
        text=True,
        env=clean_env(tmp_path),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    command = scripts / "tpuboot"
    assert os.access(command, os.X_OK)
    text = command.read_text()
    assert text.startswith("#!/usr/bin/python3\n")
    assert "from tpuboot.cli import main" in text
    modules = {p.name for p in (TOP / "tpuboot").glob("*.py")}
    assert {p.name for p in (build_dir / "tpuboot").glob("*.py")} == modules


def test_setup_cfg_floors_match_debian_control():
    """setup.cfg and debian/control state the same floors (Ubuntu 22.04's versions)."""
    setup = configparser.ConfigParser()
    setup.read(TOP / "setup.cfg")
    requires = dict(
        re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", line.strip()).groups()  # type: ignore[union-attr]
        for line in setup["options"]["install_requires"].strip().splitlines()
    )
    optional = dict(
        re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", line.strip()).groups()  # type: ignore[union-attr]
        for line in setup["options.extras_require"]["runtime-metrics"].strip().splitlines()
    )
    binary = (TOP / "debian/control").read_text().split("\nPackage: tpuboot\n")[1]
    debian = dict(re.findall(r"(python3-[a-z0-9-]+) \(>= ([^)]+)\)", binary))
    assert requires == JAMMY and optional == OPTIONAL
    assert {DEBIAN_NAMES[name]: floor for name, floor in {**requires, **optional}.items()} == debian


def test_pyproject_has_no_project_table():
    """A [project] table would win over setup.cfg on setuptools >= 61 and be ignored on 59.6:
    two sources of metadata that could drift apart."""
    tables = re.findall(r"^\[([^\]]+)\]", (TOP / "pyproject.toml").read_text(), re.MULTILINE)
    assert "build-system" in tables
    assert [t for t in tables if t.split(".")[0] == "project" or t.startswith("tool.setuptools")] == []
