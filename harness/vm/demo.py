"""`scripts/demo`: tpuboot's boot job end to end in a throwaway QEMU guest, no TPU needed.

Builds the .deb from this tree, installs it with apt into a Debian 12 guest whose PCI bus
carries TPU stand-ins (3 QEMU edu devices and a virtio-rng), boots it with the metadata
server emulator serving a sample tpu-env, and shows what an operator would look at.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from .artifacts import TESTER, build_image, ensure_artifacts
from .machine import VM
from .tpuboot_guest import EDU, KERNEL_PARAMS, VFIO_READ, build_deb, package_install_hook

STEPS = (
    ("tpuboot status", "tpuboot status"),
    ("systemctl status tpuboot", "systemctl status --no-pager --lines=12 tpuboot"),
    ("the runtime environment tpuboot wrote", "cat /home/tpu-runtime/tpu-env; echo; cat /etc/environment"),
    ("tpuboot image-check", "tpuboot image-check"),
)


def show(vm: VM, title: str, command: str) -> None:
    print(f"\n=== {title}\n$ {command}", flush=True)
    result = vm.run(command, timeout=120)
    sys.stdout.write(result.stdout + result.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the guest running until Enter is pressed")
    args = parser.parse_args(argv)
    print("building the guest (first run: about 2 minutes; then cached under .cache/vm)...", flush=True)
    artifacts = ensure_artifacts()
    with tempfile.TemporaryDirectory(prefix="tpuboot-demo-") as work:
        deb = build_deb(Path(work))
        print(f"built {deb.name}; installing it into the guest image with apt", flush=True)
        image = build_image(artifacts, Path(work) / "demo.ext4", package_install_hook(deb))
        devices = ["edu", "edu", "edu", "virtio-rng-pci"]
        with VM.from_artifacts(
            artifacts, image, devices=devices, cmdline_extra=" ".join(KERNEL_PARAMS), name="demo"
        ) as vm:
            booted = vm.wait_booted()
            print(f"guest booted to {booted.state} in {booted.seconds:.1f} s (QEMU, {vm.accel})")
            for title, command in STEPS:
                show(vm, title, command)
            edu = vm.pci_devices(*EDU)[0].address
            show(vm, f"user {TESTER} opens {edu} through VFIO and reads its ID register",
                 f"runuser -u {TESTER} -- python3 {VFIO_READ} {shlex.quote(edu)}")  # fmt: skip
            if args.keep:
                input("\nguest running; press Enter to power it off ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
