"""Build and cache what a VM boots: kernel, initramfs, Debian guest tree, disk images.

Everything expensive lives under :func:`hostenv.cache_dir` in folders named by a
hash of the step's inputs (package versions, guest files, and the source of the
function that builds it), so a step is redone only when something it depends on
changes. Each artifact is built under a temporary name and renamed into place:
an interrupted build never leaves something that looks finished.

Each guest is built for a :class:`Platform` (a Debian release: its suite, its own kernel, its
packages); every cached name starts with the platform's name, and pruning old keys only ever
looks at the same platform's entries (a bookworm build never deletes a trixie tree in use).

Layout::

    kernel/<platform>-<package>_<version>/  root/ (dpkg-deb -x, depmod run), vmlinux
    apt/<suite>/                  private apt state for a suite the host's apt does not carry
    initramfs/<platform>-<key>.cpio  busybox + root-disk modules + guest/initramfs-init
    base/<platform>-<key>/        debootstrap --variant=minbase (the slow step, ~1 min)
    tree/<platform>-<key>/        base + kernel modules + tester user + guestcmd + quiet boot

Disk images are not cached here: each test session makes its own with
:func:`build_image`, after a caller-supplied install hook has put the software
under test into a copy of the tree.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import inspect
import json
import logging
import lzma
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import hostenv, kernelimage
from .hostenv import HostError, run

log = logging.getLogger("tpuboot.vm")

KERNEL_META = "linux-image-amd64"
GUEST_DIR = Path(__file__).resolve().parent / "guest"
# Where the tree carries the bench's guest-side scripts (guestcmd, vfio_read.py).
GUEST_LIBEXEC = "/usr/local/libexec/tpuboot-test"
GUESTCMD_UNIT = "tpuboot-test-guestcmd.service"
PROBE_MARKER = "TPUBOOT-PROBE-OK"
HOSTNAME = "tpuboot-vm"
TESTER = "tester"
TESTER_UID = 1000

# What every guest needs to run tpuboot's scenarios: its init, udev, and tpuboot's dependencies.
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "udev",
    "kmod",
    "dbus",  # systemd-logind and busctl need it; without it boot ends "degraded"
    "python3",
    "python3-pyudev",
    "python3-yaml",
    "python3-requests",
    "python3-systemd",
    "python3-prometheus-client",
    "procps",
    "grub2-common",  # grub-mkconfig: proves the package's GRUB drop-in reaches the kernel line
    "grub-pc-bin",
)

GUEST_PACKAGES = (
    *BASE_PACKAGES,
    "pciutils",  # lspci for humans reading a failing test's output
    # The vBar supervisor: a real dockerd in the guest (it needs apparmor). tpuboot talks to it
    # over its socket with the standard library (tpuboot.containers.dockerapi): no docker SDK.
    "docker.io",
    "apparmor",
    "curl",  # the benchmark's baseline: the documented cloud-init script fetches tpu-env with curl
)

# Debian 13: only what the tpuboot scenarios run there need (no docker, no curl: the vBar and
# benchmark scenarios stay on Debian 12), so that its debootstrap stays short. Its GRUB is 2.12,
# as on Ubuntu 24.04: the cloud-image drop-in scenario runs on both.
TRIXIE_PACKAGES = BASE_PACKAGES


@dataclass(frozen=True)
class Platform:
    """A Debian release the bench builds a guest of, booting that release's own kernel.

    ``name`` prefixes every cached artifact of the platform (and test ids).
    """

    name: str
    suite: str
    packages: tuple[str, ...]
    kernel_meta: str = KERNEL_META
    # Installed with apt-get after debootstrap: packages whose maintainer scripts debootstrap's
    # own configuration order cannot run (podman's golang-github-containers-common).
    apt_packages: tuple[str, ...] = ()


BOOKWORM = Platform("debian12", "bookworm", GUEST_PACKAGES)
TRIXIE = Platform("debian13", "trixie", TRIXIE_PACKAGES)
PLATFORMS = (BOOKWORM, TRIXIE)

# Guests of one scenario each (tests/vm/test_cdi.py): a platform's kernel with a tree of their own,
# so the packages only they need (a container engine) lengthen no other guest's debootstrap. Not in
# PLATFORMS: the tests that run on every platform do not run on these. Their names share no prefix
# with a platform's, so pruning one never touches the other's artifacts.
# AppArmor is on in Debian's kernels: the engines load their default profile with apparmor_parser.
# Podman's default network is a CNI bridge (Debian 12's podman 4.3 without netavark): the plugins
# and iptables are Recommends that --no-install-recommends would leave out.
PODMAN_BOOKWORM = Platform(
    "podman-debian12",
    "bookworm",
    BASE_PACKAGES,
    apt_packages=("podman", "crun", "apparmor", "containernetworking-plugins", "iptables"),
)
# Debian 13 ships the docker command apart from dockerd (docker-cli).
DOCKER_TRIXIE = Platform(
    "docker-debian13", "trixie", BASE_PACKAGES, apt_packages=("docker.io", "docker-cli", "apparmor")
)
# scripts/demo's guest: Debian 12's dockerd for vBar, and podman for a container given the chips
# through tpuboot's CDI spec (Debian 12's docker 20.10 predates CDI).
DEMO_BOOKWORM = Platform("demo-debian12", "bookworm", GUEST_PACKAGES, apt_packages=("podman", "crun"))
# libtpu's runtime metrics (tests/vm/test_tpuboot_runtime.py): Debian 12's python3-grpcio, the
# package's Recommends, which no other guest needs.
GRPC_BOOKWORM = Platform("grpc-debian12", "bookworm", BASE_PACKAGES, apt_packages=("python3-grpcio",))
VARIANT_OF = {
    PODMAN_BOOKWORM.name: BOOKWORM,
    DOCKER_TRIXIE.name: TRIXIE,
    DEMO_BOOKWORM.name: BOOKWORM,
    GRPC_BOOKWORM.name: BOOKWORM,
}


def platform_named(name: str) -> Platform:
    """The platform called ``name`` (``debian12``, ``debian13``, or a variant's)."""
    for platform in (*PLATFORMS, PODMAN_BOOKWORM, DOCKER_TRIXIE, DEMO_BOOKWORM, GRPC_BOOKWORM):
        if platform.name == name:
            return platform
    raise ValueError(f"no platform {name!r}; known: {', '.join(p.name for p in PLATFORMS)}")


# Modules the initramfs needs to mount the root disk, each with the config symbol
# that says whether Debian built it in (=y, nothing to load) or as a module (=m).
# crc32c_generic must precede ext4: ext4 only soft-depends on crc32c.
ROOT_MODULES = (
    ("crc32c_generic", "CONFIG_CRYPTO_CRC32C"),
    ("virtio_pci", "CONFIG_VIRTIO_PCI"),
    ("virtio_blk", "CONFIG_VIRTIO_BLK"),
    ("ext4", "CONFIG_EXT4_FS"),
)

# Units that slow the boot, need a network, or talk on the console.
MASKED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "man-db.timer",
    "logrotate.timer",
    "systemd-tmpfiles-clean.timer",
    "systemd-timesyncd.service",
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-networkd-wait-online.service",
    "systemd-resolved.service",
    "systemd-firstboot.service",
    "getty@.service",
    "serial-getty@.service",
    "console-getty.service",
)

BUILD_TIMEOUT = 900.0


# --------------------------------------------------------------------------- helpers


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _source(*objs: Callable[..., object] | type) -> str:
    """Source text of the functions that build a step: editing them rebuilds it."""
    return "".join(inspect.getsource(obj) for obj in objs)


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].replace("\\040", " ") for line in f]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def remove_tree(path: Path) -> None:
    """Delete ``path`` without ever following a leftover mount (debootstrap mounts /proc)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    for point in _mounts_below(path):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True, timeout=30)
    run(["rm", "-rf", "--one-file-system", path], timeout=300)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(parent: Path) -> None:
    """Remove temporaries that an interrupted build (a dead process) left in ``parent``."""
    for entry in parent.glob(".*.tmp-*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            log.info("removing leftover %s", entry)
            remove_tree(entry)


@contextmanager
def _building(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; rename it into place only on success."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep(final.parent)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    remove_tree(tmp)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError as exc:
            # Another process (a benchmark beside the tests) finished the same build first: its
            # result has the same key, so it is as good as ours.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.exists():
                raise
            remove_tree(tmp)
        os.utime(final)  # cp -a kept the source's mtime; _prune goes by age
    except BaseException:
        remove_tree(tmp)
        raise


def _prune(parent: Path, keep: Path, owner: str, *, keep_count: int = 2) -> None:
    """Keep the newest ``keep_count`` entries of ``owner`` (a platform's name, or another prefix
    of the cached names; always ``keep``); old keys only waste disk. Other owners' entries, and
    unprefixed ones of older bench versions that a concurrent run may still use, are never touched."""
    prefix = f"{owner}-"
    entries = sorted(
        (p for p in parent.iterdir() if p.name.startswith(prefix) and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[keep_count - 1 :]:
        log.info("pruning old artifact %s", old)
        remove_tree(old)


@contextmanager
def _timed(what: str) -> Iterator[None]:
    start = time.monotonic()
    log.info("%s ...", what)
    yield
    log.info("%s done in %.1fs", what, time.monotonic() - start)


# --------------------------------------------------------------------------- kernel


@dataclass(frozen=True)
class Kernel:
    """Debian's kernel, unpacked. ``release`` is what ``uname -r`` prints in the guest."""

    platform: str
    package: str
    version: str
    release: str
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "root" / "boot" / f"vmlinuz-{self.release}"

    @property
    def vmlinux(self) -> Path | None:
        path = self.root / "vmlinux"
        return path if path.is_file() else None

    @property
    def boot_image(self) -> Path:
        """The uncompressed ELF for PVH boot when extraction worked, else the bzImage."""
        return self.vmlinux or self.vmlinuz

    @property
    def config(self) -> Path:
        return self.root / "root" / "boot" / f"config-{self.release}"

    @property
    def modules(self) -> Path:
        return self.root / "root" / "lib" / "modules" / self.release

    def config_value(self, symbol: str) -> str | None:
        """``y``, ``m``, a string, or None when unset."""
        for line in self.config.read_text().splitlines():
            if line.startswith(symbol + "="):
                return line.split("=", 1)[1]
        return None


APT_LISTS_MAX_AGE = 24 * 3600.0


def apt_options(platform: Platform, cache: Path) -> list[str]:
    """Options that make apt-get/apt-cache see ``platform``'s suite; none when the host's apt has it.

    The host's apt knows only its own release. For another suite, apt gets a private state (its
    own sources.list with the host's mirror URI and keyring, lists, status and package cache under
    ``cache/apt/<suite>``) while the host's apt.conf.d (proxies, transports) still applies. The
    lists are refreshed when a day old, under a lock shared by concurrent runs.
    """
    if hostenv.host_apt_has(platform.suite):
        return []
    mirror = hostenv.suite_mirror(platform.suite)
    root = cache / "apt" / platform.suite
    for d in ("lists/partial", "cache/archives/partial", "sources.list.d", "preferences.d"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "status").touch()
    signed = f" [signed-by={mirror.signed_by}]" if mirror.signed_by else ""
    (root / "sources.list").write_text(f"deb{signed} {mirror.uri} {platform.suite} main\n")
    options = {
        "Dir::Etc::SourceList": root / "sources.list",
        "Dir::Etc::SourceParts": root / "sources.list.d",
        "Dir::Etc::Preferences": root / "preferences",
        "Dir::Etc::PreferencesParts": root / "preferences.d",
        "Dir::State::Lists": root / "lists",
        "Dir::State::Status": root / "status",
        "Dir::Cache": root / "cache",
        "APT::Sandbox::User": "root",
    }
    argv = [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]
    stamp = root / "lists" / ".updated"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.is_file() or time.time() - stamp.stat().st_mtime > APT_LISTS_MAX_AGE:
            with _timed(f"apt-get update ({platform.suite}, private lists)"):
                run(["apt-get", *argv, "update", "-q"], timeout=600)
            stamp.touch()
    return argv


def resolve_kernel_package(platform: Platform, apt: Sequence[str] = ()) -> tuple[str, str]:
    """The real package (and candidate version) behind ``platform.kernel_meta``."""
    meta = platform.kernel_meta
    out = run(["apt-cache", *apt, "depends", meta], timeout=60)
    names = re.findall(r"^\s+Depends:\s+(linux-image-[^\s<>]+)\s*$", out, re.M)
    names = [n for n in names if n != meta]
    if not names:
        raise HostError(f"apt-cache depends {meta} names no kernel package (run apt-get update?)")
    package = names[0]
    policy = run(["apt-cache", *apt, "policy", package], timeout=60)
    match = re.search(r"Candidate:\s+(\S+)", policy)
    if not match or match[1] == "(none)":
        raise HostError(f"no installable version of {package} (run apt-get update?)")
    return package, match[1]


def _unpack_kernel(tmp: Path, platform: Platform, package: str, version: str, apt: Sequence[str]) -> None:
    tmp.mkdir()
    try:
        run(
            ["apt-get", *apt, "download", "-q", "-o", "APT::Sandbox::User=root", f"{package}={version}"],
            cwd=tmp,
            timeout=600,
        )
    except HostError as exc:
        raise HostError(f"{exc}\n(stale apt lists? run apt-get update)") from exc
    debs = list(tmp.glob("*.deb"))
    if len(debs) != 1:
        raise HostError(f"apt-get download {package} left {len(debs)} .deb files")
    run(["dpkg-deb", "-x", debs[0], tmp / "root"], timeout=300)
    debs[0].unlink()
    # Kernels of merged-/usr releases (trixie on) ship /usr/lib/modules only; the host's depmod
    # (bookworm's kmod 30) and Kernel.modules look in /lib/modules, as a merged system would see it.
    lib_modules, usr_modules = tmp / "root/lib/modules", tmp / "root/usr/lib/modules"
    if not lib_modules.exists() and usr_modules.is_dir():
        lib_modules.parent.mkdir(exist_ok=True)
        lib_modules.symlink_to("../usr/lib/modules")
    vmlinuz = sorted((tmp / "root" / "boot").glob("vmlinuz-*"))
    if len(vmlinuz) != 1:
        raise HostError(f"{package} holds {len(vmlinuz)} vmlinuz files")
    release = vmlinuz[0].name.removeprefix("vmlinuz-")
    run(["depmod", "-b", tmp / "root", release], timeout=300)
    try:
        (tmp / "vmlinux").write_bytes(kernelimage.extract_vmlinux(vmlinuz[0].read_bytes()))
    except kernelimage.KernelImageError as exc:
        log.warning("cannot extract vmlinux (%s): booting the slower bzImage", exc)
    meta = {"platform": platform.name, "package": package, "version": version, "release": release}
    (tmp / "kernel.json").write_text(json.dumps(meta))


def _load_kernel(root: Path) -> Kernel:
    meta = json.loads((root / "kernel.json").read_text())
    return Kernel(meta["platform"], meta["package"], meta["version"], meta["release"], root)


def ensure_kernel(platform: Platform = BOOKWORM, cache: Path | None = None) -> Kernel:
    """Download and unpack ``platform``'s current ``linux-image-amd64`` (cached by version)."""
    cache = cache or hostenv.cache_dir()
    parent = cache / "kernel"
    try:
        apt = apt_options(platform, cache)
        package, version = resolve_kernel_package(platform, apt)
        final = parent / f"{platform.name}-{package}_{version}"
        if not final.is_dir():
            with _timed(f"kernel {package} {version}"), _building(final) as tmp:
                _unpack_kernel(tmp, platform, package, version, apt)
            _prune(parent, final, platform.name)
    except HostError as exc:
        # Offline, or stale apt lists: a kernel cached earlier still does the job.
        cached = sorted(
            parent.glob(f"{platform.name}-linux-image-*/kernel.json"), key=lambda p: p.stat().st_mtime
        )
        if not cached:
            raise
        final = cached[-1].parent
        log.warning("%s; using the cached %s", str(exc).splitlines()[0], final.name)
    return _load_kernel(final)


# --------------------------------------------------------------------------- initramfs


class _Cpio:
    """Minimal writer of the ``newc`` cpio format the kernel unpacks as initramfs."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.ino = 1

    def _entry(self, name: str, mode: int, body: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        fields = [self.ino, mode, 0, 0, 1, 0, len(body), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
        self.ino += 1
        self.data += b"070701" + b"".join(b"%08x" % f for f in fields) + name.encode() + b"\0"
        self.data += b"\0" * (-len(self.data) % 4)
        self.data += body
        self.data += b"\0" * (-len(self.data) % 4)

    def directory(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, body: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, body)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return bytes(self.data)


def root_module_order(kernel: Kernel) -> list[Path]:
    """The .ko files (relative to the modules dir) to insmod, dependencies first."""
    deps: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for line in (kernel.modules / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        name = Path(target).name.split(".ko")[0].replace("-", "_")
        paths[name] = target
        deps[target] = rest.split()
    order: list[str] = []

    def visit(target: str) -> None:
        for dep in deps.get(target, []):
            visit(dep)
        if target not in order:
            order.append(target)

    for module, symbol in ROOT_MODULES:
        value = kernel.config_value(symbol)
        if value == "y":
            continue
        if value != "m" or module not in paths:
            raise HostError(
                f"{kernel.release}: {symbol}={value} and no {module}.ko: cannot mount the root disk"
            )
        visit(paths[module])
    return [Path(p) for p in order]


def _module_bytes(path: Path) -> bytes:
    """A module as busybox insmod takes it: plain ELF (trixie's kernel ships them xz-compressed)."""
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(path.read_bytes())
    if not path.name.endswith(".ko"):
        raise HostError(f"{path.name}: a compression the initramfs cannot load; add it to _module_bytes")
    return path.read_bytes()


def _write_initramfs(dest: Path, kernel: Kernel, init: str, busybox: bytes) -> None:
    cpio = _Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"):
        cpio.directory(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", busybox, 0o755)
    cpio.symlink("bin/sh", "busybox")
    cpio.file("init", init.encode(), 0o755)
    names = []
    for ko in root_module_order(kernel):
        names.append(ko.name.removesuffix(".xz"))
        cpio.file(f"lib/modules/{names[-1]}", _module_bytes(kernel.modules / ko))
    cpio.file("lib/modules/load-order", "".join(f"{name}\n" for name in names).encode())
    dest.write_bytes(cpio.finish())


def ensure_initramfs(kernel: Kernel, cache: Path | None = None) -> Path:
    """Busybox initramfs for ``kernel``: loads the root-disk modules, switch_root to systemd.

    Uncompressed: under TCG, unpacking gzip costs more than loading 4 MB more.
    """
    parent = (cache or hostenv.cache_dir()) / "initramfs"
    init = (GUEST_DIR / "initramfs-init").read_text().replace("@@PROBE_MARKER@@", PROBE_MARKER)
    busybox = hostenv.BUSYBOX.read_bytes()
    key = _digest(
        kernel.root.name,
        init,
        busybox,
        _source(_Cpio, root_module_order, _module_bytes, _write_initramfs),
        repr(ROOT_MODULES),
    )
    final = parent / f"{kernel.platform}-{key}.cpio"
    if not final.is_file():
        with _timed(f"initramfs {kernel.platform}"), _building(final) as tmp:
            _write_initramfs(tmp, kernel, init, busybox)
        _prune(parent, final, kernel.platform)
    return final


# --------------------------------------------------------------------------- guest tree


def _debootstrap(tmp: Path, platform: Platform) -> None:
    mirror = hostenv.suite_mirror(platform.suite)
    argv = ["debootstrap", "--variant=minbase", "--include=" + ",".join(platform.packages)]
    if mirror.signed_by and Path(mirror.signed_by).is_file():
        argv.append(f"--keyring={mirror.signed_by}")
    run([*argv, platform.suite, tmp, mirror.uri], timeout=BUILD_TIMEOUT)
    # The downloaded .debs are 50 MB the image would carry for nothing.
    for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()


def _apt_install(tmp: Path, platform: Platform) -> None:
    """``platform.apt_packages`` into the debootstrapped tree, from the mirror debootstrap used."""
    chroot_run(tmp, ["apt-get", "update"], timeout=BUILD_TIMEOUT)
    install = ["apt-get", "install", "-y", "--no-install-recommends", *platform.apt_packages]
    chroot_run(tmp, install, timeout=BUILD_TIMEOUT)
    chroot_run(tmp, ["apt-get", "clean"])
    for lists in (tmp / "var/lib/apt/lists").glob("*_Packages*"):
        lists.unlink()


def ensure_base(platform: Platform = BOOKWORM, cache: Path | None = None) -> Path:
    """A plain ``debootstrap --variant=minbase`` tree of ``platform`` with its packages."""
    parent = (cache or hostenv.cache_dir()) / "base"
    key = _digest(platform.suite, *sorted(platform.packages), _source(_debootstrap))
    if platform.apt_packages:  # (the platforms' keys stay as they were)
        key = _digest(key, *platform.apt_packages, _source(_apt_install))
    final = parent / f"{platform.name}-{key}"
    if not final.is_dir():
        with _timed(f"debootstrap {platform.suite}"), _building(final) as tmp:
            _debootstrap(tmp, platform)
            if platform.apt_packages:
                _apt_install(tmp, platform)
        _prune(parent, final, platform.name)
    return final


def _guest_files() -> list[Path]:
    return sorted(p for p in GUEST_DIR.iterdir() if p.is_file() and p.name != "initramfs-init")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _mask(tree: Path, units: Iterable[str]) -> None:
    etc = tree / "etc/systemd/system"
    for unit in units:
        link = etc / unit
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("/dev/null")


def _customize(tree: Path, kernel: Kernel) -> None:
    """Turn a debootstrap tree into the bench's guest (runs on a copy of the base)."""
    modules = tree / "usr/lib/modules" / kernel.release
    modules.parent.mkdir(parents=True, exist_ok=True)
    run(["cp", "-a", kernel.modules, modules], timeout=300)
    for name in (f"config-{kernel.release}", f"System.map-{kernel.release}"):
        shutil.copy2(kernel.root / "root/boot" / name, tree / "boot" / name)
    run(["depmod", "-b", tree, kernel.release], timeout=300)

    run(
        [
            "useradd",
            "--root",
            tree,
            "--uid",
            str(TESTER_UID),
            "--user-group",
            "--create-home",
            "--shell",
            "/bin/bash",
            TESTER,
        ],
        timeout=60,
    )
    _write(tree / "etc/hostname", HOSTNAME + "\n")
    _write(tree / "etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost\n")
    _write(tree / "etc/fstab", "/dev/vda\t/\text4\trw,errors=remount-ro\t0\t0\n")
    # No network interface exists: resolving anything must fail fast, not wait.
    _write(tree / "etc/resolv.conf", "")
    _write(tree / "etc/systemd/journald.conf.d/tpuboot-test.conf", "[Journal]\nStorage=volatile\n")
    _write(tree / "etc/systemd/system.conf.d/tpuboot-test.conf", "[Manager]\nShowStatus=auto\n")

    _mask(tree, MASKED_UNITS)
    default = tree / "etc/systemd/system/default.target"
    default.unlink(missing_ok=True)
    default.symlink_to("/lib/systemd/system/multi-user.target")

    libexec = tree / GUEST_LIBEXEC.lstrip("/")
    libexec.mkdir(parents=True, exist_ok=True)
    for src in _guest_files():
        if src.suffix == ".service":
            shutil.copy2(src, tree / "etc/systemd/system" / src.name)
        else:
            shutil.copy2(src, libexec / src.name)
            (libexec / src.name).chmod(0o755)
    wants = tree / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / GUESTCMD_UNIT).symlink_to(f"/etc/systemd/system/{GUESTCMD_UNIT}")


def ensure_tree(kernel: Kernel, platform: Platform = BOOKWORM, cache: Path | None = None) -> Path:
    """The guest's root tree: base + kernel modules + user ``tester`` + command server."""
    cache = cache or hostenv.cache_dir()
    base = ensure_base(platform, cache)
    parent = cache / "tree"
    guest = [p.name.encode() + p.read_bytes() for p in _guest_files()]
    key = _digest(
        base.name,
        kernel.root.name,
        *guest,
        _source(_customize, _mask, _write),
        repr((MASKED_UNITS, HOSTNAME, TESTER, TESTER_UID, GUEST_LIBEXEC)),
    )
    final = parent / f"{platform.name}-{key}"
    if not final.is_dir():
        with _timed(f"guest tree {platform.name}"), _building(final) as tmp:
            run(["cp", "-a", "--reflink=auto", base, tmp], timeout=300)
            _customize(tmp, kernel)
        _prune(parent, final, platform.name)
    return final


# --------------------------------------------------------------------------- all together


@dataclass(frozen=True)
class Artifacts:
    """Everything cached that a VM needs besides its disk image."""

    kernel: Kernel
    initrd: Path
    tree: Path
    platform: Platform = BOOKWORM

    @property
    def boot_kernel(self) -> Path:
        """The file to give QEMU's ``-kernel`` (vmlinux when available)."""
        return self.kernel.boot_image


def ensure_artifacts(
    cache: Path | None = None,
    *,
    platform: Platform = BOOKWORM,
    on_boot_files: Callable[[Kernel, Path], None] | None = None,
) -> Artifacts:
    """Build (or find) ``platform``'s kernel, initramfs and guest tree.

    ``on_boot_files(kernel, initrd)`` runs as soon as the kernel and initramfs exist,
    before the slow tree step: the pytest fixture starts the accelerator probe there.
    """
    problem = hostenv.host_problem()
    if problem:
        raise HostError(problem)
    cache = cache or hostenv.cache_dir()
    kernel = ensure_kernel(VARIANT_OF.get(platform.name, platform), cache)  # a variant: its platform's
    initrd = ensure_initramfs(kernel, cache)
    if on_boot_files:
        on_boot_files(kernel, initrd)
    return Artifacts(kernel, initrd, ensure_tree(kernel, platform, cache), platform)


# --------------------------------------------------------------------------- images

InstallHook = Callable[[Path], None]
"""``install(tree)``: put the software under test into a copy of the guest tree."""


def in_tree(tree: Path, guest_path: str) -> Path:
    """Where the guest's absolute ``guest_path`` lives in ``tree``.

    Use it in install hooks: ``tree / "/etc/x"`` is the host's /etc/x (pathlib
    drops ``tree`` before an absolute part).
    """
    rel = guest_path.lstrip("/")
    if not rel or ".." in Path(rel).parts:
        raise ValueError(f"not a path inside the guest: {guest_path!r}")
    return tree / rel


CHROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}


def chroot_run(tree: Path, argv: Sequence[str], *, timeout: float = 300.0) -> str:
    """Run ``argv`` inside ``tree`` with chroot, for install hooks; returns stdout.

    Nothing is mounted inside (no /proc): enough for dpkg, useradd, systemctl enable.
    """
    return run(["chroot", tree, *argv], timeout=timeout, env=CHROOT_ENV)


def install_debs(tree: Path, debs: Sequence[Path]) -> None:
    """``apt-get install ./x.deb`` in ``tree``, as an image builder does, with no download.

    apt resolves the dependencies against what the tree has installed (they must be there).
    No service starts: the chroot has no running systemd, so deb-systemd-invoke skips.
    """
    staging = tree / "tmp/tpuboot-debs"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        names = []
        for deb in debs:
            shutil.copy2(deb, staging / Path(deb).name)
            names.append(f"/tmp/tpuboot-debs/{Path(deb).name}")
        chroot_run(tree, ["apt-get", "install", "-y", "--no-install-recommends", *names])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _stamp_updated(tree: Path) -> None:
    """Mark /etc and /var as up to date with /usr: skips ConditionNeedsUpdate units at boot.

    The disk is booted with snapshot=on, so they would otherwise run at every boot.
    """
    seconds = int(time.time())
    ns = seconds * 1_000_000_000
    usr = tree / "usr"
    os.utime(usr, ns=(ns, ns), follow_symlinks=False)
    for name in ("etc/.updated", "var/.updated"):
        path = tree / name
        path.write_text(f"# This file was created by the tpuboot test bench.\nTIMESTAMP_NSEC={ns}\n")
        os.utime(path, ns=(ns, ns))


def _tree_bytes(tree: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(tree):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


@contextmanager
def writable_copy(tree: Path, work: Path) -> Iterator[Path]:
    """A writable view of ``tree`` that leaves ``tree`` untouched.

    An overlayfs mount costs nothing; where the host refuses it, a full copy
    (about 10 s for the 700 MB tree) does the same job.
    """
    remove_tree(work)
    upper, scratch, merged = work / "upper", work / "work", work / "merged"
    for d in (upper, scratch, merged):
        d.mkdir(parents=True)
    try:
        try:
            run(
                ["mount", "-t", "overlay", "overlay", "-o",
                 f"lowerdir={tree},upperdir={upper},workdir={scratch}", merged],
                timeout=30,
            )  # fmt: skip
        except HostError as exc:
            log.info("overlayfs unavailable (%s); copying the tree", str(exc).splitlines()[0])
            merged.rmdir()
            run(["cp", "-a", "--reflink=auto", tree, merged], timeout=600)
        yield merged
    finally:
        if merged.is_mount():
            # Innermost first: a hook may have mounted /proc or /dev inside for a chroot.
            for point in [*_mounts_below(merged), str(merged)]:
                subprocess.run(["umount", "-l", point], check=False, capture_output=True, timeout=30)
        remove_tree(work)


def build_image(
    artifacts: Artifacts,
    dest: Path,
    install: InstallHook | None = None,
    *,
    headroom_mb: int = 512,
) -> Path:
    """Run ``install`` on a writable view of the cached tree and make an ext4 image at ``dest``.

    The cached tree itself is never modified. Boot the image with ``snapshot=on``
    (``VM`` does) so one image serves many boots. ``headroom_mb`` of free space
    is left for what tests write in the guest.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.with_name(f".{dest.name}.tmp-tree-{os.getpid()}")
    with _timed(f"image {dest.name}"), writable_copy(artifacts.tree, work) as tree:
        if install is not None:
            install(tree)
        _stamp_updated(tree)
        size_mb = int(_tree_bytes(tree) * 1.3 / 2**20) + headroom_mb
        with _building(dest) as tmp:
            run(["mkfs.ext4", "-q", "-F", "-L", "tpuboot-root", "-d", tree, tmp, f"{size_mb}M"], timeout=600)
    return dest
