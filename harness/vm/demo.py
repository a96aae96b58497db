"""`scripts/demo`: tpuboot's three boot jobs, and what it does after boot, in a throwaway QEMU guest.

Builds the .deb from this tree, installs it with apt into a Debian 12 guest whose PCI bus carries
TPU stand-ins (3 QEMU edu devices, and a virtio-rng behind a PCIe root port with AER), boots it
with the metadata server emulator serving a sample tpu-env, and shows what an operator would look
at. tpuboot runs on its built-in defaults, with only the stand-ins added to its device table: it
supervises vBar under the guest's dockerd (a stand-in image, imported at dockerd's start under the
name the documented procedure pulls, since no registry is reachable). After boot: a job holding a
chip named by `tpuboot who`, a container given the chips through tpuboot's CDI spec without
--privileged (podman: Debian 12's docker 20.10 predates CDI), and an AER error in doctor's PCIe check.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV
from tpuboot.config import VbarConfig

from .artifacts import DEMO_BOOKWORM, TESTER, TESTER_UID, build_image, ensure_artifacts, in_tree
from .machine import VM
from .tpuboot_guest import (
    DOCTOR_ENV,
    EDU,
    KERNEL_PARAMS,
    PROBE_IMAGE,
    PROBE_TAR,
    STAND_INS,
    VBAR_CONTAINER,
    VFIO_READ,
    VIRTIO_RNG,
    build_deb,
    probe_rootfs_tar,
    stand_in_install_hook,
    wait_vbar_running,
)

#: vBar's image as tpu-env names it on a TPU VM: the default one (a registry tpuboot allows).
VBAR_IMAGE = VbarConfig().image
TPU_ENV = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": VBAR_IMAGE}
#: The defaults, with the stand-ins added to the device table.
CONFIG = yaml.safe_dump({"devices": STAND_INS}, sort_keys=False)
DEVICES = [
    "edu",
    "edu",
    "edu",
    "pcie-root-port,id=demo-port,chassis=7,slot=1",
    "virtio-rng-pci,bus=demo-port,id=demo-rng,aer=on,disable-legacy=off",  # 1af4:1005, a PCIe link
]
JOB = "tpuboot-demo-job"
#: podman's own boot units: they restart and update containers the demo has none of, and cost
#: about 40 s of a TCG boot.
QUIET_UNITS = ("podman-auto-update.timer", "podman-auto-update.service", "podman-restart.service")


def install_hook(deb: Path) -> Callable[[Path], None]:
    """The .deb, the defaults plus the stand-ins, the emulator, vBar's stand-in and the probe image."""
    base = stand_in_install_hook(deb, CONFIG, TPU_ENV, {VBAR_IMAGE: "/vbar"})

    def hook(tree: Path) -> None:
        base(tree)
        for unit in QUIET_UNITS:
            link = in_tree(tree, f"/etc/systemd/system/{unit}")
            link.unlink(missing_ok=True)
            link.symlink_to("/dev/null")
        probe = in_tree(tree, PROBE_TAR)
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(probe_rootfs_tar())

    return hook


def section(title: str) -> None:
    print(f"\n===== {title}", flush=True)


def show(vm: VM, command: str, timeout: float = 120, env: dict[str, str] | None = None) -> None:
    print(f"$ {command}", flush=True)
    result = vm.run(command, timeout=timeout, env=env)
    sys.stdout.write(result.stdout + result.stderr)


def boot_jobs(vm: VM) -> None:
    section("1. TPUs bound to vfio-pci at boot, each node open to users, each PCIe link against its best")
    show(vm, "tpuboot status")
    section("2. tpu-env written from the metadata server, and its keys added to /etc/environment")
    show(vm, "cat /home/tpu-runtime/tpu-env; echo; cat /etc/environment")
    section("3. vBar supervised under dockerd: privileged, on the host network, answering at its endpoint")
    wait_vbar_running(vm, timeout=150)
    columns = "{{.Names}}  {{.Image}}  {{.Status}}"
    show(vm, f"docker ps --format '{columns}' --filter name={VBAR_CONTAINER}")
    section("the service: READY, and STATUS with all three jobs")
    show(vm, "systemctl status --no-pager --lines=0 tpuboot")
    section("the image's kernel, limit and udev settings in force")
    show(vm, "tpuboot image-check")


def after_boot(vm: VM) -> None:
    edu = vm.pci_devices(*EDU)[0].address
    group = vm.run(f"basename $(readlink /sys/bus/pci/devices/{edu}/iommu_group)", check=True).stdout.strip()
    node = f"/dev/vfio/{group}"
    section(f"after boot: a job of user {TESTER} holds chip {edu}; `tpuboot who` names it (exit 1: held)")
    vm.run(
        [
            "systemd-run",
            "--quiet",
            f"--uid={TESTER}",
            f"--unit={JOB}",
            "sh",
            "-c",
            f"exec 3<>{node}; exec sleep 600",
        ],
        check=True,
    )
    vm.wait_until(f"ls -l /proc/$(systemctl show -P MainPID {JOB})/fd | grep -q {node}", timeout=60)
    show(vm, "tpuboot who")
    vm.run(["systemctl", "stop", JOB], check=True)

    section(
        f"after boot: a container without --privileged, as uid {TESTER_UID}, gets the chips from the CDI spec"
    )
    vm.run(["podman", "import", PROBE_TAR, PROBE_IMAGE], check=True, timeout=300)
    show(
        vm,
        f"podman run --rm --user {TESTER_UID}:{TESTER_UID} --network none --device google.com/tpu=all "
        f"-v /usr:/usr:ro {PROBE_IMAGE} python3 {VFIO_READ} {shlex.quote(edu)}",
        timeout=300,
    )

    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    section(f"after boot: {rng.address} reports a non-fatal PCIe error; doctor's PCIe check says what to do")
    vm.qmp("human-monitor-command", **{"command-line": "pcie_aer_inject_error demo-rng POISON_TLP"})
    vm.wait_until(f"grep -q '^TOTAL_ERR_NONFATAL [1-9]' /sys/bus/pci/devices/{rng.address}/aer_dev_nonfatal")
    show(vm, "tpuboot doctor | grep pcie-health", env=DOCTOR_ENV)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the guest running until Enter is pressed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    print("building the guest (first run: about 5 minutes; then cached under .cache/vm)...", flush=True)
    artifacts = ensure_artifacts(platform=DEMO_BOOKWORM)
    with tempfile.TemporaryDirectory(prefix="tpuboot-demo-") as work:
        deb = build_deb(Path(work))
        print(f"built {deb.name}; installing it into the guest image with apt", flush=True)
        image = build_image(artifacts, Path(work) / "demo.ext4", install_hook(deb))
        with VM.from_artifacts(
            artifacts, image, devices=DEVICES, cmdline_extra=" ".join(KERNEL_PARAMS), memory=1536, name="demo"
        ) as vm:
            booted = vm.wait_booted()
            print(f"guest booted to {booted.state} in {booted.seconds:.1f} s (QEMU, {vm.accel})")
            boot_jobs(vm)
            after_boot(vm)
            print(f"\ndemo done in {time.monotonic() - started:.0f} s")
            if args.keep:
                input("\nguest running; press Enter to power it off ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
