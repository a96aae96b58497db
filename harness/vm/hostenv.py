"""Host side facts the bench depends on: cache folder, prerequisites, apt mirror.

The network here reaches only package registries, and the repository must not
name any registry host, so the Debian mirror is read from the host's own apt
configuration at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "TPUBOOT_VM_CACHE"
REPO_ROOT = Path(__file__).resolve().parents[2]
QEMU = "qemu-system-x86_64"

# Host tools each build step shells out to; missing ones are reported together.
REQUIRED_TOOLS = (
    QEMU,
    "apt-get",
    "apt-cache",
    "dpkg-deb",
    "debootstrap",
    "depmod",
    "mkfs.ext4",
    "useradd",
    "chroot",
    "mount",
)
BUSYBOX = Path("/bin/busybox")


class HostError(RuntimeError):
    """The host cannot run the bench (not root, a tool missing, a command failed)."""


def cache_dir() -> Path:
    """Where artifacts live: ``$TPUBOOT_VM_CACHE`` or ``<repo>/.cache/vm``."""
    override = os.environ.get(CACHE_ENV)
    path = Path(override) if override else REPO_ROOT / ".cache" / "vm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def host_problem() -> str | None:
    """One line saying why VM tests cannot run here, or None when they can."""
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("not running as root (debootstrap, chroot, mount and mkfs need it)")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if not BUSYBOX.is_file():
        missing.append(f"{BUSYBOX} (busybox-static)")
    if missing:
        problems.append(f"missing on the host: {', '.join(missing)} (install scripts/host-packages.txt)")
    return "; ".join(problems) or None


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run a host command; on failure raise HostError with its output's tail."""
    args = [os.fspath(a) for a in argv]
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise HostError(f"{args[0]} timed out after {timeout:.0f}s: {' '.join(args)}") from exc
    except FileNotFoundError as exc:
        raise HostError(f"{args[0]} not found on the host") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise HostError(f"{' '.join(args)} exited {proc.returncode}:\n{tail}")
    return proc.stdout


@dataclass(frozen=True)
class AptSource:
    """One ``deb`` entry of the host's apt configuration."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None


def _deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    stanza: dict[str, str] = {}
    key = ""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanza:
                yield stanza
            stanza, key = {}, ""
        elif line[0] in " \t" and key:
            stanza[key] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            stanza[key] = value.strip()
    if stanza:
        yield stanza


def apt_sources(etc: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every enabled binary (``deb``) source in sources.list and sources.list.d."""
    sources: list[AptSource] = []
    one_line = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for path in one_line:
        if not path.is_file():
            continue
        for raw in path.read_text(errors="replace").splitlines():
            line = raw.split("#", 1)[0].strip()
            # deb [opt=val ...] uri suite [component ...]
            match = re.match(r"deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s*(.*)", line)
            if not match:
                continue
            opts, uri, suite, comps = match.groups()
            signed = re.search(r"signed-by=(\S+)", opts or "")
            sources.append(AptSource(uri, (suite,), tuple(comps.split()), signed[1] if signed else None))
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for st in _deb822_stanzas(path.read_text(errors="replace")):
            if "deb" not in st.get("types", "").split() or st.get("enabled", "yes").lower() == "no":
                continue
            for uri in st.get("uris", "").split():
                sources.append(
                    AptSource(
                        uri,
                        tuple(st.get("suites", "").split()),
                        tuple(st.get("components", "").split()),
                        st.get("signed-by") or None,
                    )
                )
    return sources


def debian_mirror(suite: str, etc: Path = Path("/etc/apt")) -> AptSource:
    """The host's apt source that carries ``suite`` with component ``main``."""
    for src in apt_sources(etc):
        if suite in src.suites and "main" in src.components:
            return src
    raise HostError(f"no apt source for suite {suite!r} with component main in /etc/apt; cannot debootstrap")


def host_apt_has(suite: str, etc: Path = Path("/etc/apt")) -> bool:
    """Whether the host's own apt configuration carries ``suite`` (component main)."""
    return any(suite in src.suites and "main" in src.components for src in apt_sources(etc))


def host_codename(os_release: Path = Path("/etc/os-release")) -> str:
    """The host's release codename (``bookworm`` on the CI and development hosts)."""
    match = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", os_release.read_text(), re.M)
    if not match:
        raise HostError(f"{os_release} names no VERSION_CODENAME; cannot find the host's Debian archive")
    return match[1]


def suite_mirror(suite: str, etc: Path = Path("/etc/apt"), host_suite: str | None = None) -> AptSource:
    """Where to fetch ``suite`` from: the host's source for it, or else the host's Debian archive.

    A Debian 12 host carries only bookworm, but the archive that serves it (same URI, same keyring:
    debian-archive-keyring holds the newer releases' keys too) serves trixie as well.
    """
    if host_apt_has(suite, etc):
        return debian_mirror(suite, etc)
    archive = debian_mirror(host_suite or host_codename(), etc)
    return AptSource(archive.uri, (suite,), ("main",), archive.signed_by)


def connect_unix(path: Path, timeout: float) -> socket.socket | None:
    """Connect to a Unix socket QEMU creates at start-up, retrying until it exists; None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
