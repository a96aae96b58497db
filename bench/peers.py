"""The tools people already run for tpuboot's jobs, installed into the bench's guest image.

* ``driverctl`` (Debian's, a bash script): ``driverctl set-override DBDF vfio-pci`` binds a device
  by hand and saves the override in /etc/driverctl.d; at boot (and on hot add) its udev rule
  ``05-driverctl.rules`` makes systemd start ``driverctl@pci-DBDF.service``, which runs
  ``driverctl load-override``. driverctl leaves the /dev/vfio node root-only, so its side also
  gets the one udev rule a user would add for unprivileged access (``MODE="0666"``, what tpuboot
  and the documented script do) and ``allow_unsafe_interrupts`` as a module option.
* ``google-guest-agent`` (Debian's, Go): the agent every GCE VM runs, with its metadata long-poll.
  Installed disabled; the idle family starts it alone, against a second in-guest metadata
  emulator (``harness/mds_emulator.py``, already in the guest) on 169.254.169.254:80.

The .debs are bookworm's (``apt-get download``, with the private apt state the kernel download
uses when the host runs another release), cached under the VM cache. Their
udev rules are masked in the image (a /dev/null link in /etc/udev/rules.d) so that tpuboot's and
the documented procedure's families run exactly as without them; ``bind_guest.py driverctl
on|off`` arms and disarms them.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.vm.artifacts import BOOKWORM, InstallHook, apt_options, chroot_run, in_tree, install_debs

log = logging.getLogger("bench.peers")

PEER_PACKAGES = ("driverctl", "google-guest-agent")
DRIVERCTL_RULES = ("05-driverctl.rules", "89-vfio-uio.rules")
# Lets the bench reset driverctl@ units between reps (a second add of the same device would not
# start an already active RemainAfterExit unit); changes nothing on the path being timed.
DRIVERCTL_DROP_IN = "[Unit]\nRefuseManualStop=no\n"
GGA_UNITS = (
    "google-guest-agent.service",
    "google-startup-scripts.service",
    "google-shutdown-scripts.service",
)
GCE_MDS_ADDRESS = "169.254.169.254"
# What the guest agent's config leaves on: see gga_config(). Instance values it reads at start.
GCE_INSTANCE_FILE = "/usr/local/libexec/tpuboot-bench/gce-instance.yaml"
GCE_INSTANCE = {
    "id": "4242424242",
    "hostname": "tpu-vm-0.c.bench.internal",
    "zone": "projects/1/zones/us-east5-a",
}


def download_peers(cache: Path, packages: Sequence[str] = PEER_PACKAGES) -> list[Path]:
    """The peers' .debs from bookworm (the guest's release, whatever the host runs), fetched once
    with apt into ``cache/peers``."""
    apt = apt_options(BOOKWORM, cache)
    dest = cache / "peers"
    dest.mkdir(parents=True, exist_ok=True)
    debs: list[Path] = []
    with open(dest / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in packages:
            found = sorted(dest.glob(f"{name}_*.deb"))
            if not found:
                with tempfile.TemporaryDirectory(dir=dest) as tmp:
                    subprocess.run(
                        ["apt-get", *apt, "download", "-q", "-o", "APT::Sandbox::User=root", name],
                        cwd=tmp, check=True, capture_output=True, timeout=600,
                    )  # fmt: skip
                    for deb in Path(tmp).glob("*.deb"):
                        shutil.move(str(deb), dest / deb.name)
                found = sorted(dest.glob(f"{name}_*.deb"))
            if not found:
                raise RuntimeError(f"apt-get download {name} left no .deb in {dest}")
            debs.append(found[-1])
    return debs


def deb_version(deb: Path) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def gga_config(text: str) -> str:
    """The guest agent's instance_configs.cfg with its network managers off (the guest has no NIC).

    On a TPU VM they act only when the metadata changes, so the idle figures do not depend on
    them; everything else (accounts, clock skew, OS Login, metadata scripts) stays as shipped.
    """
    off = {
        ("Daemons", "network_daemon"),
        ("NetworkInterfaces", "setup"),
        ("NetworkInterfaces", "ip_forwarding"),
    }
    section = ""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
        elif "=" in stripped and (section, stripped.split("=", 1)[0].strip()) in off:
            line = f"{stripped.split('=', 1)[0].strip()} = false"
        out.append(line)
    return "\n".join(out) + "\n"


def peers_install_hook(debs: Sequence[Path]) -> InstallHook:
    """driverctl and google-guest-agent installed, both inert until the bench arms them."""

    def install(tree: Path) -> None:
        install_debs(tree, debs)
        rules = in_tree(tree, "/etc/udev/rules.d")
        rules.mkdir(parents=True, exist_ok=True)
        for name in DRIVERCTL_RULES:
            mask = rules / name
            mask.unlink(missing_ok=True)
            mask.symlink_to("/dev/null")
        drop_in = in_tree(tree, "/etc/systemd/system/driverctl@.service.d/tpuboot-bench.conf")
        drop_in.parent.mkdir(parents=True, exist_ok=True)
        drop_in.write_text(DRIVERCTL_DROP_IN)
        modprobe = in_tree(tree, "/etc/modprobe.d/tpuboot-bench-vfio.conf")
        modprobe.parent.mkdir(parents=True, exist_ok=True)
        modprobe.write_text("options vfio_iommu_type1 allow_unsafe_interrupts=1\n")
        chroot_run(tree, ["systemctl", "disable", *GGA_UNITS])
        cfg = in_tree(tree, "/etc/default/instance_configs.cfg")
        cfg.write_text(gga_config(cfg.read_text()))
        in_tree(tree, GCE_INSTANCE_FILE).write_text(json.dumps(GCE_INSTANCE) + "\n")  # JSON is YAML

    return install


def peer_ratio(ours: float, theirs: float) -> float | None:
    if math.isnan(ours) or math.isnan(theirs) or theirs <= 0:
        return None
    return ours / theirs
