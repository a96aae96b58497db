"""tpuboot in a guest: put into the tree the way image builders do (the .deb built from this
source), then read and steered in the running guest.

The guest also gets the metadata server emulator as a service on 127.0.0.1:8080 and a
drop-in that points tpuboot at it, so the daemon's whole boot job runs with no network; tests
change what it serves (``put_tpu_env``, ``set_attribute``) from inside the guest.
"""

from __future__ import annotations

import io
import os
import shlex
import shutil
import tarfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV, tpu_env_yaml
from harness.polling import wait_until
from tpuboot.kernel_params import needed

from .artifacts import GUEST_LIBEXEC, TESTER, in_tree, install_debs
from .hostenv import BUSYBOX, run
from .machine import VM, PciDevice

REPO = Path(__file__).resolve().parents[2]

EDU = (0x1234, 0x11E8)  # QEMU's edu device: no host driver
VIRTIO_RNG = (0x1AF4, 0x1005)  # bound to virtio-pci first, so the unbind path runs
VIRTIO_BLK = (0x1AF4, 0x1001)  # the guest's boot disk: must never be touched
EDU_ID_REGISTER = "0x010000ed"  # BAR0 offset 0 of the edu device
VFIO_READ = f"{GUEST_LIBEXEC}/vfio_read.py"
MDS_PORT = 8080
MDS_CONTROL = f"http://127.0.0.1:{MDS_PORT}/_emulator/v1/instance/attributes"
# The kernel parameters the package's GRUB drop-in asks for on the guests' x86_64. The harness
# boots its kernel directly, not through GRUB: a guest that must look complete gets them on its
# command line.
KERNEL_PARAMS = tuple(needed("x86_64"))
# StatusText of a guest with the four stand-ins of ``guest_config()`` and SAMPLE_TPU_ENV served.
READY_STATUS = "4 TPUs bound to vfio-pci; tpu-env: 14 keys from metadata"

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


def write_in_tree(tree: Path, path: str, text: str, mode: int = 0o644) -> None:
    target = in_tree(tree, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    target.chmod(mode)


def enable_unit(tree: Path, unit: str, unit_dir: str = "/lib/systemd/system") -> None:
    link = in_tree(tree, f"/etc/systemd/system/multi-user.target.wants/{unit}")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        os.symlink(f"{unit_dir}/{unit}", link)


# --- the running guest ---------------------------------------------------------------------------

# PUT (a value) or DELETE (none) an attribute at the emulator's control endpoint (stdlib only).
CONTROL_SCRIPT = (
    "import sys, urllib.request; "
    "data = sys.argv[2].encode() if len(sys.argv) > 2 else None; "
    "urllib.request.urlopen(urllib.request.Request(sys.argv[1], data, method='PUT' if data else 'DELETE'))"
)


def set_attribute(vm: VM, key: str, value: str | None) -> None:
    """Change (None: remove) the instance attribute ``key`` the guest's metadata emulator serves."""
    vm.run(
        ["python3", "-c", CONTROL_SCRIPT, f"{MDS_CONTROL}/{key}", *([] if value is None else [value])],
        check=True,
    )


def put_tpu_env(vm: VM, values: Mapping[str, str]) -> None:
    """Change the tpu-env attribute the guest's metadata emulator serves (in the text the emulator
    makes of its attributes file: the same values put back leave the ETag, and tpuboot, alone)."""
    set_attribute(vm, "tpu-env", tpu_env_yaml(values))


def status_text(vm: VM) -> str:
    """tpuboot's StatusText (what ``systemctl status`` shows)."""
    return vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"], check=True).stdout.strip()


def wait_bound_with_tpu_env(vm: VM, count: int, timeout: float = 90.0) -> None:
    """Until STATUS says ``count`` TPUs are bound and tpu-env has its part (the boot's sync ended)."""
    vm.wait_until(
        f"systemctl show -P StatusText tpuboot | grep -q '^{count} TPUs bound to vfio-pci; tpu-env: '",
        timeout=timeout,
        interval=1.0,
    )


def sourced(vm: VM, shell: str, path: str) -> dict[str, str]:
    """The variables ``set -a; . FILE`` gives ``shell``, NUL-separated so any value survives."""
    script = f"set -a; . {shlex.quote(path)}; env -0"
    out = vm.run(["env", "-i", shell, "-c", script], check=True).stdout_bytes
    pairs = (item.decode().split("=", 1) for item in out.split(b"\0") if item)
    return {k: v for k, v in pairs if k not in ("PWD", "SHLVL", "_")}


def stand_ins(vm: VM) -> list[PciDevice]:
    """The PCI functions standing in for TPUs (edu and virtio-rng)."""
    return vm.pci_devices(*EDU) + vm.pci_devices(*VIRTIO_RNG)


def node_mode(vm: VM, group: int | None) -> str:
    """The octal mode of ``/dev/vfio/<group>``."""
    return vm.run(["stat", "-c", "%a", f"/dev/vfio/{group}"], check=True).stdout.strip()


def vfio_read(vm: VM, address: str, python: str = "python3") -> str:
    """The device's BAR0 identification register, read by an unprivileged user through VFIO."""
    result = vm.run([python, VFIO_READ, address], user=TESTER, timeout=30)
    assert result.ok, result.stderr
    return result.stdout.strip()


def hotplug_edu(vm: VM, id: str, port: int) -> PciDevice:
    """Hot-add an edu as ``id`` into hotplug port ``port``; wait until tpuboot has bound it."""
    before = {d.address for d in vm.pci_devices(*EDU)}
    vm.device_add("edu", id=id, bus=vm.hotplug_ports[port])

    def new_and_bound() -> bool:
        new = [d for d in vm.pci_devices(*EDU) if d.address not in before]
        return len(new) == 1 and new[0].driver == "vfio-pci"

    wait_until(new_and_bound, timeout=20, interval=0.1)
    (new,) = [d for d in vm.pci_devices(*EDU) if d.address not in before]
    return new


def unplug(vm: VM, id: str, tpus: int) -> None:
    """Remove the hot-added ``id``; wait until tpuboot's status counts ``tpus`` bound again."""
    vm.device_del(id)
    vm.wait_until(f"systemctl show -P StatusText tpuboot | grep -q '^{tpus} TPUs bound'", timeout=10)


# --- the guest tree --------------------------------------------------------------------------------


def install_emulator(tree: Path, tpu_env: dict[str, str] | None = None) -> None:
    """The metadata emulator as a guest service, serving ``tpu-env`` and a drop-in aiming tpuboot at it."""
    shutil.copy(REPO / "harness/mds_emulator.py", in_tree(tree, f"{GUEST_LIBEXEC}/mds_emulator.py"))
    attributes = {"tpu-env": tpu_env if tpu_env is not None else SAMPLE_TPU_ENV}
    write_in_tree(tree, "/etc/tpuboot-test/attributes.yaml", yaml.safe_dump(attributes, sort_keys=False))
    write_in_tree(tree, "/etc/systemd/system/tpuboot-test-mds.service", MDS_UNIT)
    enable_unit(tree, "tpuboot-test-mds.service", "/etc/systemd/system")
    write_in_tree(tree, "/etc/systemd/system/tpuboot.service.d/test-metadata.conf", MDS_DROP_IN)


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
        write_in_tree(tree, "/etc/tpuboot/tpuboot.yaml", config if config is not None else guest_config())
        install_emulator(tree)

    return install


# --- what the guest's daemon shows ----------------------------------------------------------------

#: Where the guest's metadata emulator listens, for a command that asks it (doctor's GKE check).
DOCTOR_ENV = {"GCE_METADATA_HOST": "127.0.0.1:8080"}
#: The daemon's metrics endpoint (metrics.address and metrics.port by default), and a python3
#: program that prints one scrape of it.
METRICS_URL = "http://127.0.0.1:9431/metrics"
SCRAPE = f"import urllib.request; print(urllib.request.urlopen({METRICS_URL!r}, timeout=10).read().decode())"


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


#: The vBar stand-in answers where vBar does (tpuboot's default vbar.endpoint): busybox's httpd
#: accepts there, in the background (its PID in VBAR_LISTENER_PID), while the script sleeps.
VBAR_LISTENER_PID = "/listener.pid"
VBAR_SCRIPT = (
    f"/bin/busybox httpd -f -p 127.0.0.1:8353 -h / &\necho $! > {VBAR_LISTENER_PID}\n"
    "echo vbar stand-in up\nexec /bin/busybox sleep 1000000\n"
).encode()


def vbar_rootfs_tar() -> bytes:
    """busybox, /bin/sh, /vbar (says it is up, answers at 127.0.0.1:8353, sleeps) and /collector
    (prints the config it finds at COLLECTOR_CONFIG, then sleeps) as a tarball for ``docker import``."""
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
        add("vbar", VBAR_SCRIPT, 0o644)
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
        write_in_tree(
            tree, "/etc/systemd/system/docker.service.d/tpuboot-test-images.conf", VBAR_DOCKER_DROP_IN
        )
        write_in_tree(tree, VBAR_IMPORT_SCRIPT, script)
        write_in_tree(tree, "/etc/docker/daemon.json", DOCKER_DAEMON_JSON)
        for path, text in (files or {}).items():
            write_in_tree(tree, path, text)

    return hook


# --- a guest whose tpuboot supervises vBar (the stand-in images) under a real dockerd -------------

VBAR_CONTAINER = "tpuboot-vbar-control-agent"
VBAR_IMAGE_1 = "tpuboot-test/vbar:1"
VBAR_IMAGE_2 = "tpuboot-test/vbar:2"
VBAR_TPU_ENV = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": VBAR_IMAGE_1}
VBAR_CONFIG = guest_config(
    # The stand-in images are local names, which dockerd reads as Docker Hub's.
    vbar={
        "enabled": True,
        "image": "tpuboot-test/vbar:config",
        "registries": ["docker.io/tpuboot-test"],
        # Two ticks (the watchdog's 30 s) after the first unanswered probe: time to look at it.
        "restart_unanswered_after": 60,
    },
    supervisor={"backoff_initial": 1, "backoff_max": 8, "stable_after": 60, "pull_retries": 6},
)


def vbar_guest_hook(deb: Path) -> Callable[[Path], None]:
    """The vBar guest: ``VBAR_CONFIG``, the emulator serving ``VBAR_TPU_ENV``, both stand-in images."""
    return vbar_install_hook(deb, VBAR_CONFIG, VBAR_TPU_ENV, (VBAR_IMAGE_1, VBAR_IMAGE_2))


def wait_vbar_running(vm: VM, timeout: float = 90.0) -> None:
    """Until the vBar container runs and tpuboot's status says so."""
    vm.wait_until(
        f"[ \"$(docker inspect -f '{{{{.State.Running}}}}' {VBAR_CONTAINER} 2>/dev/null)\" = true ] && "
        "systemctl show -P StatusText tpuboot | grep -q 'vBar: running'",
        timeout=timeout,
        interval=0.5,
    )


def managed_containers(vm: VM) -> list[str]:
    """The ids of the containers tpuboot labelled as its own."""
    out = vm.run(["docker", "ps", "-aq", "--no-trunc", "--filter", "label=io.tpuboot.managed=1"], check=True)
    return out.stdout.split()


# --- a container image that reads a stand-in through VFIO (tests/vm/test_cdi.py, scripts/demo) ------

#: A busybox rootfs the guest imports into its engine (no registry): run with the guest's /usr
#: bind-mounted read-only, it has python3 and vfio_read.py.
PROBE_TAR = "/var/lib/tpuboot-test/probe-rootfs.tar"
PROBE_IMAGE = "localhost/tpuboot-test/probe:1"


def probe_rootfs_tar() -> bytes:
    """busybox as /bin/sh, and the links the guest's /usr needs to run its python3 from a mount."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for name, target in (("bin/sh", "busybox"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tar.addfile(link)
        for name in ("usr", "tmp", "proc", "sys", "dev"):
            folder = tarfile.TarInfo(name)
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
    return buf.getvalue()
