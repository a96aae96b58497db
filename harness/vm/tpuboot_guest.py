"""Put tpuboot into a guest tree the way image builders do: the .deb built from this source.

The guest also gets the metadata server emulator as a service on 127.0.0.1:8080 and a
drop-in that points tpuboot at it, so the daemon's whole boot job runs with no network.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV

from .artifacts import GUEST_LIBEXEC, in_tree, install_debs
from .hostenv import BUSYBOX, run

REPO = Path(__file__).resolve().parents[2]

EDU = (0x1234, 0x11E8)  # QEMU's edu device: no host driver
VIRTIO_RNG = (0x1AF4, 0x1005)  # bound to virtio-pci first, so the unbind path runs
VIRTIO_BLK = (0x1AF4, 0x1001)  # the guest's boot disk: must never be touched
EDU_ID_REGISTER = "0x010000ed"  # BAR0 offset 0 of the edu device
VFIO_READ = f"{GUEST_LIBEXEC}/vfio_read.py"
MDS_PORT = 8080
MDS_CONTROL = f"http://127.0.0.1:{MDS_PORT}/_emulator/v1/instance/attributes"

STAND_INS = [
    {"name": "edu stand-in", "vendor": EDU[0], "device": EDU[1]},
    {"name": "virtio-rng stand-in", "vendor": VIRTIO_RNG[0], "device": VIRTIO_RNG[1]},
]

MDS_UNIT = f"""[Unit]
Description=GCE metadata server emulator (tpuboot tests)
DefaultDependencies=no
After=local-fs.target
Before=tpuboot.service
# Stopped by systemd at poweroff (not left to systemd-shutdown's last SIGTERM/SIGKILL round).
Conflicts=shutdown.target
Before=shutdown.target

[Service]
ExecStart=/usr/bin/python3 {GUEST_LIBEXEC}/mds_emulator.py --port {MDS_PORT} \\
    --attributes /etc/tpuboot-test/attributes.yaml
TimeoutStopSec=5

[Install]
WantedBy=multi-user.target
"""

MDS_DROP_IN = f"""[Unit]
Wants=tpuboot-test-mds.service
After=tpuboot-test-mds.service

[Service]
Environment=GCE_METADATA_HOST=127.0.0.1:{MDS_PORT}
"""


def guest_config(**sections: object) -> str:
    """The guest's /etc/tpuboot/tpuboot.yaml: the stand-in devices plus any extra sections.

    vBar is off unless a section turns it on: a guest with no image for it would show a failed
    pull in every status line (tests/vm/test_tpuboot_vbar.py turns it on).
    """
    return yaml.safe_dump({"devices": STAND_INS, "vbar": {"enabled": False}, **sections}, sort_keys=False)


def _write(tree: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = in_tree(tree, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(mode)


def _enable(tree: Path, unit: str, unit_dir: str = "/lib/systemd/system") -> None:
    link = in_tree(tree, f"/etc/systemd/system/multi-user.target.wants/{unit}")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        os.symlink(f"{unit_dir}/{unit}", link)


def install_emulator(tree: Path, tpu_env: dict[str, str] | None = None) -> None:
    """The metadata emulator as a guest service, serving ``tpu-env`` and a drop-in aiming tpuboot at it."""
    shutil.copy(REPO / "harness/mds_emulator.py", in_tree(tree, f"{GUEST_LIBEXEC}/mds_emulator.py"))
    attributes = {"tpu-env": tpu_env if tpu_env is not None else SAMPLE_TPU_ENV}
    _write(tree, "/etc/tpuboot-test/attributes.yaml", yaml.safe_dump(attributes, sort_keys=False))
    _write(tree, "/etc/systemd/system/tpuboot-test-mds.service", MDS_UNIT)
    _enable(tree, "tpuboot-test-mds.service", "/etc/systemd/system")
    _write(tree, "/etc/systemd/system/tpuboot.service.d/test-metadata.conf", MDS_DROP_IN)


def build_deb(dest: Path) -> Path:
    """Build the .deb from this source tree (scripts/build-deb) into ``dest``."""
    out = run([str(REPO / "scripts/build-deb"), str(dest)], timeout=600)
    deb = Path(out.strip().splitlines()[-1])
    if not deb.is_file():
        raise RuntimeError(f"scripts/build-deb did not leave a .deb: {out!r}")
    return deb


def package_install_hook(deb: Path, config: str | None = None) -> Callable[[Path], None]:
    """An install hook for ``vm_image_factory``: the .deb, the stand-in config and the emulator."""

    def install(tree: Path) -> None:
        install_debs(tree, [deb])
        _write(tree, "/etc/tpuboot/tpuboot.yaml", config if config is not None else guest_config())
        install_emulator(tree)

    return install


# --- the vBar stand-in, for a guest whose tpuboot supervises vBar under a real dockerd ---------

VBAR_ROOTFS = f"{GUEST_LIBEXEC}/vbar-rootfs.tar"
VBAR_IMPORT_SCRIPT = f"{GUEST_LIBEXEC}/import-vbar-images"
VBAR_DOCKER_DROP_IN = f"""[Service]
# The vBar stand-in images, made locally (harness/vm/tpuboot_guest.py).
ExecStartPost=-/bin/sh {VBAR_IMPORT_SCRIPT}
"""
# No bridge or iptables set-up: the agents use the host network, and it costs 30 s under TCG.
DOCKER_DAEMON_JSON = '{"bridge": "none", "iptables": false}\n'


#: Where the collector stand-in looks for its configuration, and says what it found.
COLLECTOR_CONFIG = "/etc/ai-telemetry-collector/config.yaml"
COLLECTOR_SCRIPT = (
    f"if [ -f {COLLECTOR_CONFIG} ]; then echo 'collector config:'; /bin/busybox cat {COLLECTOR_CONFIG}; "
    f"else echo 'collector: no config at {COLLECTOR_CONFIG}'; fi\n"
    "echo 'collector stand-in up'\nexec /bin/busybox sleep 1000000\n"
).encode()


def vbar_rootfs_tar() -> bytes:
    """busybox, /bin/sh, /vbar (says it is up, then sleeps) and /collector (prints the config it
    finds at COLLECTOR_CONFIG, then sleeps) as a tarball for ``docker import``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))

        add("bin/busybox", BUSYBOX.read_bytes(), 0o755)
        link = tarfile.TarInfo("bin/sh")
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        tar.addfile(link)
        add("vbar", b"echo vbar stand-in up\nexec /bin/busybox sleep 1000000\n", 0o644)
        add("collector", COLLECTOR_SCRIPT, 0o644)
    return buf.getvalue()


def vbar_install_hook(
    deb: Path, config: str, tpu_env: dict[str, str], images: Sequence[str]
) -> Callable[[Path], None]:
    """The .deb with ``config`` (vBar on), the emulator serving ``tpu-env``, and stand-in vBar
    ``images`` that dockerd imports at each start (no registry is reachable)."""
    return stand_in_install_hook(deb, config, tpu_env, {image: "/vbar" for image in images})


def stand_in_install_hook(
    deb: Path,
    config: str,
    tpu_env: dict[str, str],
    images: Mapping[str, str],
    files: Mapping[str, str] | None = None,
) -> Callable[[Path], None]:
    """The .deb with ``config``, the emulator serving ``tpu-env``, stand-in ``images`` (name →
    the script of the stand-in rootfs it runs: /vbar or /collector) that dockerd imports at each
    start, and extra guest ``files`` (path → text)."""
    base = package_install_hook(deb, config)
    script = "".join(
        f"docker image inspect {image} >/dev/null 2>&1 || "
        f'docker import --change \'CMD ["/bin/sh", "{cmd}"]\' {VBAR_ROOTFS} {image}\n'
        for image, cmd in images.items()
    )

    def hook(tree: Path) -> None:
        base(tree)
        install_emulator(tree, tpu_env)
        in_tree(tree, VBAR_ROOTFS).write_bytes(vbar_rootfs_tar())
        _write(tree, "/etc/systemd/system/docker.service.d/tpuboot-test-images.conf", VBAR_DOCKER_DROP_IN)
        _write(tree, VBAR_IMPORT_SCRIPT, script)
        _write(tree, "/etc/docker/daemon.json", DOCKER_DAEMON_JSON)
        for path, text in (files or {}).items():
            _write(tree, path, text)

    return hook
