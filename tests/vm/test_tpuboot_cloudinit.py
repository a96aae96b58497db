"""The image build paths, for real (issue 13, item 6): Debian's cloud-init with a NoCloud seed
installs the .deb and runs ``tpuboot prepare-image`` on a build VM; the same disk then boots as a
TPU VM.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm import hostenv
from harness.vm.artifacts import (
    CHROOT_ENV,
    Artifacts,
    _building,
    _digest,
    _source,
    _timed,
    build_image,
    in_tree,
    remove_tree,
)
from harness.vm.hostenv import run
from harness.vm.machine import ROOT_DISK_ID, VM
from harness.vm.tpuboot_guest import (
    DOCKER_DAEMON_JSON,
    DOCTOR_ENV,
    VBAR_DOCKER_DROP_IN,
    VBAR_IMPORT_SCRIPT,
    VBAR_ROOTFS,
    guest_config,
    install_emulator,
    vbar_rootfs_tar,
)

pytestmark = pytest.mark.vm

CLOUD_INIT_PACKAGES = ("cloud-init",)


def _install_cloud_init(tmp: Path, tree: Path) -> None:
    run(["cp", "-a", "--reflink=auto", tree, tmp], timeout=600)
    proc = tmp / "proc"
    resolv = tmp / "etc/resolv.conf"
    resolv.write_bytes(Path("/etc/resolv.conf").read_bytes())  # the guest's own is empty (no network)
    run(["mount", "-t", "proc", "proc", proc], timeout=30)
    try:
        env = {**CHROOT_ENV}
        run(["chroot", tmp, "apt-get", "update", "-q"], timeout=600, env=env)
        run(
            [
                "chroot",
                tmp,
                "apt-get",
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                *CLOUD_INIT_PACKAGES,
            ],
            timeout=900,
            env=env,
        )
        run(["chroot", tmp, "apt-get", "clean"], timeout=60, env=env)
    finally:
        run(["umount", "-l", proc], timeout=30)
        resolv.write_text("")
    for lists in (tmp / "var/lib/apt/lists").glob("*_dists_*"):
        lists.unlink()


def ensure_cloudinit_tree(tree: Path, cache: Path | None = None) -> Path:
    """The bench's Debian 12 tree with Debian's cloud-init installed by apt (cached by the tree's key).

    debootstrap --include=cloud-init fails in its unordered base configuration step
    (python3-cryptography), so cloud-init goes in afterwards with apt, in a chroot.
    """
    parent = (cache or hostenv.cache_dir()) / "cloudinit"
    final = parent / f"{tree.name}-{_digest(repr(CLOUD_INIT_PACKAGES), _source(_install_cloud_init))}"
    if not final.is_dir():
        parent.mkdir(parents=True, exist_ok=True)
        for old in parent.iterdir():
            if old != final and not old.name.startswith("."):
                remove_tree(old)
        with _timed("guest tree with cloud-init"), _building(final) as tmp:
            _install_cloud_init(tmp, tree)
    return final


# --------------------------------------------------------------------------- the scenario

DEB_IN_IMAGE = "/opt/image-build/tpuboot.deb"
CONFIG_IN_IMAGE = "/opt/image-build/tpuboot.yaml"
SEED = "/var/lib/cloud/seed/nocloud"
PREPARE_JSON = "/var/log/tpuboot-prepare-image.json"
PREPARE_RC = "/var/log/tpuboot-prepare-image.rc"
VBAR_IMAGE = "tpuboot-test/vbar:config"
CONFIG = guest_config(
    # The stand-in image is a local name, which dockerd reads as Docker Hub's.
    vbar={"enabled": True, "image": VBAR_IMAGE, "registries": ["docker.io/tpuboot-test"]},
)
# The build instance's user-data, as a Packer googlecompute build or `gcloud compute instances
# create --metadata-from-file user-data=...` gives it: install the .deb, the site's configuration,
# then prepare-image, its verdict kept for the pipeline. The .deb is in the image (no network).
USER_DATA = f"""#cloud-config
runcmd:
  - [apt-get, install, -y, --no-install-recommends, {DEB_IN_IMAGE}]
  - [cp, {CONFIG_IN_IMAGE}, /etc/tpuboot/tpuboot.yaml]
  - [systemctl, start, docker.service]
  - sh -c 'tpuboot prepare-image --json > {PREPARE_JSON}; echo $? > {PREPARE_RC}'
"""
META_DATA = "instance-id: tpuboot-build-1\nlocal-hostname: tpuboot-build\n"
# No NIC in the guest: cloud-init must not look for one to configure. minbase generates no
# en_US.UTF-8, cloud-init's default locale (update-locale refuses it): C.UTF-8 is always there.
NO_NETWORK = "network: {config: disabled}\nlocale: C.UTF-8\n"
# A GCE Debian image's /etc/default/grub (grub-pc's; the bench tree has only grub2-common).
DEBIAN_GRUB = """GRUB_DEFAULT=0
GRUB_TIMEOUT=0
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX="console=ttyS0,38400n8"
"""
# What grub-mkconfig does with the defaults: source them in order (run in the guest, by its sh).
GRUB_SOURCE = (
    "if [ -f /etc/default/grub ]; then . /etc/default/grub; fi; "
    'for f in /etc/default/grub.d/*.cfg; do if [ -e "$f" ]; then . "$f"; fi; done; '
    "echo $GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT"
)
NEXT_BOOT = (
    "from tpuboot.checks.parsers.grub import next_boot; from tpuboot.paths import Root; "
    "print(' '.join(next_boot(Root('/'), 'amd64').words))"
)
TPU_ENV = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": VBAR_IMAGE}


def build_vm_image(deb: Path) -> Callable[[Path], None]:
    """The base image a build starts from: Debian with cloud-init and docker.io, the NoCloud seed,
    the .deb and the site's tpuboot.yaml waiting, and the test platform (metadata emulator with
    no tpu-env, as on an ordinary VM; dockerd importing the stand-in image at each start)."""

    def hook(tree: Path) -> None:
        put(tree, DEB_IN_IMAGE, deb.read_bytes())
        put(tree, CONFIG_IN_IMAGE, CONFIG)
        put(tree, f"{SEED}/user-data", USER_DATA)
        put(tree, f"{SEED}/meta-data", META_DATA)
        put(tree, "/etc/cloud/cloud.cfg.d/99-tpuboot-test.cfg", NO_NETWORK)
        put(tree, "/etc/default/grub", DEBIAN_GRUB)
        install_emulator(tree, {})
        put(tree, "/etc/tpuboot-test/attributes.yaml", "{}\n")  # no tpu-env: not a TPU VM
        put(tree, VBAR_ROOTFS, vbar_rootfs_tar())
        put(tree, "/etc/systemd/system/docker.service.d/tpuboot-test-images.conf", VBAR_DOCKER_DROP_IN)
        put(
            tree,
            VBAR_IMPORT_SCRIPT,
            f"docker image inspect {VBAR_IMAGE} >/dev/null 2>&1 || "
            f'docker import --change \'CMD ["/bin/sh", "/vbar"]\' {VBAR_ROOTFS} {VBAR_IMAGE}\n',
        )
        put(tree, "/etc/docker/daemon.json", DOCKER_DAEMON_JSON)

    return hook


def put(tree: Path, path: str, data: str | bytes) -> None:
    target = in_tree(tree, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    target.write_bytes(data)


@pytest.fixture(scope="module")
def cloudinit_artifacts(vm_artifacts: Artifacts) -> Artifacts:
    tree = ensure_cloudinit_tree(vm_artifacts.tree)
    return dataclasses.replace(vm_artifacts, tree=tree)


@dataclass
class Build:
    """What the build boot left: prepare-image's verdict, and the captured disk."""

    results: dict[str, dict[str, str]]
    status: int
    events: str
    journal: str
    next_boot: str
    disk: Path


@pytest.fixture(scope="module")
def build(
    cloudinit_artifacts: Artifacts, tpuboot_deb: Path, tmp_path_factory: pytest.TempPathFactory
) -> Build:
    """Boot the base image as a build VM (no TPU, no tpu-env), let cloud-init do the build, then
    capture the disk: QEMU's snapshot committed into a copy of the image, as the build's disk."""
    folder = tmp_path_factory.mktemp("cloudinit")
    base = build_image(cloudinit_artifacts, folder / "base.ext4", build_vm_image(tpuboot_deb))
    disk = folder / "captured.ext4"
    shutil.copyfile(base, disk)
    base.unlink()
    with VM.from_artifacts(cloudinit_artifacts, disk, memory=1536, name="cloudinit-build") as vm:
        vm.wait_booted(timeout=1200)  # the boot includes the build (cloud-final); TCG, shared CPU
        vm.run(["cloud-init", "status", "--wait"], timeout=600)  # its exit says nothing we need
        status = vm.run(["cloud-init", "status", "--long"], check=True, timeout=120).stdout
        assert "status: done" in status, status
        boot_start = vm.run('date -d "$(uptime -s)" +%s', check=True).stdout.strip()
        events = vm.run(
            ["docker", "events", "--since", boot_start, "--until", "0s", "--filter", "type=container"],
            check=True,
            timeout=120,
        ).stdout
        results = {r["name"]: r for r in json.loads(vm.read_file(PREPARE_JSON))}
        rc = int(vm.read_file(PREPARE_RC).decode().strip())
        journal = vm.journal("tpuboot")
        sourced = vm.run(["sh", "-c", GRUB_SOURCE], check=True).stdout.split()
        ours = vm.run(["python3", "-c", NEXT_BOOT], check=True).stdout.split()
        assert ours == sourced  # tpuboot's reading of the defaults is sh's, on the real files
        # What is not the image's but the platform's changes for the next instance: the seed goes
        # (a NoCloud cidata disk is detached; GCE gives its own datasource), and the emulated
        # metadata server of the new instance serves tpu-env, as GCE's does on a TPU VM.
        vm.run(["rm", "-r", SEED], check=True)
        attributes = yaml.safe_dump({"tpu-env": TPU_ENV}, sort_keys=False)
        vm.write_file("/etc/tpuboot-test/attributes.yaml", attributes)
        # Capture: everything on the disk, the guest paused, the snapshot written into the image.
        vm.run(["sync"], check=True, timeout=120)
        vm.qmp("stop")
        vm.qmp("human-monitor-command", timeout=300, **{"command-line": f"commit {ROOT_DISK_ID}"})
        vm.kill()
    return Build(results, rc, events, journal, " ".join(sourced), disk)


def test_cloud_init_installed_the_package_and_prepare_image_passed(build: Build) -> None:
    failed = {n: r for n, r in build.results.items() if r["status"] == "FAIL"}
    assert build.status == 0 and not failed, failed
    for name in ("cmdline-idle-poll", "cmdline-transparent-hugepage", "cmdline-intel-iommu"):
        assert build.results[name]["status"] == "PASS"
        assert build.results[name]["detail"].startswith("next boot's command line (update-grub) has ")
    for name in ("pam-memlock", "pam-nofile", "systemd-default-limits", "accel-udev-rule"):
        assert build.results[name]["status"] == "PASS", build.results[name]
    assert build.results["service"]["status"] == "PASS"
    assert build.results["containers"]["detail"] == "no container labelled io.tpuboot.managed=1"
    # No registry is reachable: the stand-in dockerd imported at start is the copy kept.
    assert build.results["pull-vbar"]["status"] == "WARN"
    assert f"cannot pull {VBAR_IMAGE}" in build.results["pull-vbar"]["detail"]


def test_the_build_boot_ran_no_container(build: Build) -> None:
    assert build.events.strip() == ""
    assert "not a TPU VM" in build.journal
    assert "vBar: running" not in build.journal


@pytest.fixture(scope="module")
def tpu_vm(cloudinit_artifacts: Artifacts, build: Build) -> Iterator[VM]:
    """The captured disk booted as a TPU VM: stand-ins present, the kernel line GRUB would give
    it, this instance's metadata server serving tpu-env, no NoCloud seed."""
    params = [
        w
        for w in build.next_boot.split()
        if w.split("=")[0] in ("idle", "transparent_hugepage", "intel_iommu")
    ]
    with VM.from_artifacts(
        cloudinit_artifacts,
        build.disk,
        devices=["edu"] * 4,  # the v5p-8 the emulator's tpu-env describes: 4 chips on this host
        cmdline_extra=" ".join(params),
        memory=1536,
        name="cloudinit-tpu",
    ) as vm:
        vm.wait_booted(timeout=1200)  # TCG on a shared CPU
        vm.wait_until(
            "systemctl show -P StatusText tpuboot | grep -q 'vBar: running'", timeout=600, interval=1.0
        )
        yield vm


def test_the_captured_image_boots_as_a_tpu_vm_and_doctor_passes(tpu_vm: VM) -> None:
    status = tpu_vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"], check=True).stdout
    assert status.startswith("4 TPUs bound to vfio-pci; tpu-env: ")
    done = tpu_vm.run(["tpuboot", "doctor", "--json"], env=DOCTOR_ENV, timeout=300)
    verdicts = {v["name"]: v for v in json.loads(done.stdout)}
    # Required checks only: Debian 12's Docker 20.10 reads no CDI spec (cdi-docker, advisory).
    failing = {n: v for n, v in verdicts.items() if v["status"] == "FAIL" and v["required"]}
    assert (done.rc, failing) == (0, {})
    assert verdicts["chip-count"]["status"] == "PASS"
    for name in (
        "tpus-bound",
        "cmdline-idle-poll",
        "cmdline-intel-iommu",
        "tpu-env",
        "tpu-env-fresh",
        "vbar-running",
    ):
        assert verdicts[name]["status"] == "PASS", verdicts[name]
    # cloud-init found no datasource on this instance: the build's runcmd did not run again.
    assert "apt-get" not in tpu_vm.run(["journalctl", "-b", "-u", "cloud-final", "-o", "cat"]).stdout
