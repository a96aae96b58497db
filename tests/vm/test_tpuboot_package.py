"""The .deb as an image builder uses it: installed with apt into a Debian 12 and a Debian 13 guest,
booted, checked from inside, upgraded with the admin's edits in place, then purged without a trace.

GRUB: Debian 12 has grub 2.06 (as Ubuntu 22.04), Debian 13 grub 2.12 (as Ubuntu 24.04), so the
package's drop-in meets both grub-mkconfig versions Ubuntu ships, with and without the drop-ins
Ubuntu's cloud images carry.

The guest boots with the kernel parameters the package's GRUB drop-in asks for (the bench boots
its kernel directly, not through GRUB), so `tpuboot image-check` sees a complete image.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import PLATFORMS, Platform, in_tree
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import KERNEL_PARAMS, package_install_hook

from .conftest import BenchFactory

pytestmark = pytest.mark.vm

MAX_EXPOSURE = 3.1  # `systemd-analyze security`: 0 is best, 10 is a unit with no sandbox at all
ADMIN_EDIT = "# edited by the admin: keep me\n"
LIST_FILES = "import os, sys; [print(p) for p in sys.argv[1:] if os.path.isfile(p)]"
STUB_UNIT = "[Service]\nExecStart=/bin/sleep infinity\n"
# /etc/environment as an admin left it in the image, before tpuboot's first boot: two keys tpuboot
# manages, set to other values, one in another spelling. tpuboot must keep both, and so must purge.
ADMIN_ENVIRONMENT = 'CLOUDSDK_PYTHON=/opt/python3.11/bin/python3\nexport GCS_RESOLVE_REFRESH_SECS="120"\n'
# What tpuboot adds at boot: the keys the admin did not set.
TPUBOOT_LINES = [
    "GCS_REQUEST_CONNECTION_TIMEOUT_SECS=300",
    "GCS_METADATA_REQUEST_TIMEOUT_SECS=300",
    "GCS_READ_REQUEST_TIMEOUT_SECS=300",
    "GCS_WRITE_REQUEST_TIMEOUT_SECS=600",
]


@pytest.fixture(scope="module")
def upgrade_deb(tpuboot_deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same package with a higher version, as the next release would be."""
    work = tmp_path_factory.mktemp("upgrade")
    subprocess.run(["dpkg-deb", "-R", tpuboot_deb, work / "pkg"], check=True)
    control = work / "pkg/DEBIAN/control"
    control.write_text(re.sub(r"(?m)^Version: (.*)$", r"Version: \1+next1", control.read_text()))
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", work / "pkg", work / "next.deb"], check=True)
    return work / "next.deb"


@pytest.fixture(scope="module", params=PLATFORMS, ids=lambda p: p.name)
def vm(
    request: pytest.FixtureRequest, vm_bench: BenchFactory, tpuboot_deb: Path, upgrade_deb: Path
) -> Iterator[VM]:
    platform: Platform = request.param
    bench = vm_bench(platform)
    install = package_install_hook(tpuboot_deb)

    def hook(tree: Path) -> None:
        install(tree)
        # The real kernel in /boot and a /boot/grub, as on a system where GRUB is installed, so
        # grub-mkconfig writes the kernel's entry.
        kernel = bench.artifacts.kernel
        in_tree(tree, "/boot/grub").mkdir(parents=True, exist_ok=True)
        shutil.copy(kernel.vmlinuz, in_tree(tree, f"/boot/vmlinuz-{kernel.release}"))
        shutil.copy(upgrade_deb, in_tree(tree, "/root/tpuboot-next.deb"))
        in_tree(tree, "/etc/environment").write_text(ADMIN_ENVIRONMENT)

    image = bench.image(hook, key="tpuboot-package")
    with VM.from_artifacts(
        bench.artifacts,
        image,
        devices=["edu", "edu"],
        cmdline_extra=" ".join(KERNEL_PARAMS),
        name=f"package-{platform.name}",
    ) as machine:
        machine.wait_booted()
        yield machine


def sh(vm: VM, script: str, timeout: float = 120) -> str:
    return vm.run(script, check=True, timeout=timeout).stdout


def test_service_enabled_and_active(vm: VM) -> None:
    assert sh(vm, "systemctl is-enabled tpuboot").strip() == "enabled"
    assert sh(vm, "systemctl is-active tpuboot").strip() == "active"
    assert sh(vm, "systemctl show -P StatusText tpuboot").startswith("2 TPUs bound to vfio-pci; tpu-env: ")


def test_sandbox_exposure_under_a_live_systemd(vm: VM) -> None:
    """The README records this score; the unit's hardening must not quietly regress."""
    report = sh(vm, "systemd-analyze security --no-pager tpuboot.service")
    match = re.search(r"Overall exposure level for tpuboot.service: ([0-9.]+)", report)
    assert match, report[-500:]
    assert float(match.group(1)) <= MAX_EXPOSURE, report[-2000:]


def login_limits(vm: VM, start: str = "") -> list[str]:
    """memlock and nofile of a fresh ``su -l tester`` session (what PAM's limits give a login).

    su runs in a transient unit, with ``start`` limits or else the service manager's current
    defaults: never inheriting the test agent's, which it got at boot and keeps after a purge
    (Debian 13's pam_limits keeps an inherited limit that no limits.d entry sets).
    """
    props = f"-p LimitMEMLOCK={start} -p LimitNOFILE={start}" if start else ""
    return sh(vm, f"systemd-run --wait --pipe --quiet {props} su -l tester -c 'ulimit -l; ulimit -n'").split()


def test_login_shell_limits(vm: VM) -> None:
    assert login_limits(vm, start="65536") == ["unlimited", "100000"]  # raised by limits.d/tpuboot.conf


def test_service_manager_and_container_runtime_limits(vm: VM) -> None:
    manager = sh(vm, "systemctl show -P DefaultLimitMEMLOCK; systemctl show -P DefaultLimitNOFILE").split()
    assert manager == ["infinity", "100000"]
    # Stand-ins for docker and containerd: the package's drop-ins must apply to whatever unit is there.
    stubs = [f"/etc/systemd/system/{unit}.service" for unit in ("docker", "containerd")]
    for stub in stubs:
        vm.write_file(stub, STUB_UNIT)
    try:
        sh(vm, "systemctl daemon-reload")
        shown = sh(vm, "systemctl show docker containerd -p LimitMEMLOCK -p LimitNOFILE")
        assert sorted(shown.split()) == ["LimitMEMLOCK=infinity"] * 2 + ["LimitNOFILE=100000"] * 2
    finally:
        # Left in place, they make Debian 13's poweroff wait a minute at teardown.
        sh(vm, f"rm -f {' '.join(stubs)}; systemctl daemon-reload")


def test_accel_rule_installed(vm: VM) -> None:
    rules = sh(vm, "cat /lib/udev/rules.d/70-tpuboot.rules")
    assert 'KERNEL=="accel*", MODE="0666"' in rules


def test_image_check_passes_on_the_booted_image(vm: VM) -> None:
    result = vm.run(["tpuboot", "image-check"], timeout=60)
    assert result.rc == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


def kernel_lines(vm: VM) -> list[list[str]]:
    """The words of each ``linux`` line grub-mkconfig writes now (normal and recovery entries)."""
    sh(vm, "grub-mkconfig -o /tmp/grub.cfg 2>/dev/null", timeout=180)
    text = sh(vm, "cat /tmp/grub.cfg")
    lines = [line.split() for line in text.splitlines() if line.strip().startswith("linux")]
    assert lines, "grub-mkconfig wrote no kernel line"
    return lines


def assert_each_tpu_parameter_once(line: list[str]) -> None:
    for param in KERNEL_PARAMS:
        name = param.split("=")[0] + "="
        assert [word for word in line if word.startswith(name)] == [param], " ".join(line)


def test_grub_config_carries_the_kernel_parameters(vm: VM) -> None:
    for line in kernel_lines(vm):
        assert_each_tpu_parameter_once(line)


# Test copies of the GRUB drop-ins of Ubuntu's cloud images, as Canonical's image build
# (livecd-rootfs, live-build/ubuntu-cpc) writes them:
# - 50-cloudimg-settings.cfg: hooks.d/base/imagecraft-configs/cloud-init/etc/default/grub.d/
#   50-cloudimg-settings.cfg, plus the two lines hooks.d/base/disk-image-uefi.binary appends on
#   amd64 (GRUB_PRELOAD_MODULES). It *sets* GRUB_CMDLINE_LINUX_DEFAULT: the console.
# - 40-force-partuuid.cfg: written by disk-image-uefi.binary on minimized images (GCE's are) as
#   GRUB_FORCE_PARTUUID=<root partition's PARTUUID>. Ubuntu's grub-mkconfig then tries an
#   initrd-less boot; Debian's grub ignores the variable, so here it only proves that sourcing it
#   changes nothing for tpuboot.
CLOUDIMG_SETTINGS = """\
# Cloud Image specific Grub settings for Generic Cloud Images
# CLOUD_IMG: This file was created/modified by the Cloud Image build process

# Set the recordfail timeout
GRUB_RECORDFAIL_TIMEOUT=0

# Do not wait on grub prompt
GRUB_TIMEOUT=0

# Set the default commandline
GRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"

# Set the grub console type
GRUB_TERMINAL=console
# CLOUD_IMG: This file was created/modified by the Cloud Image build process
# For Cloud Image compatability
GRUB_PRELOAD_MODULES="multiboot serial usb usb_keyboard"
"""
FORCE_PARTUUID = "GRUB_FORCE_PARTUUID=6f0c2c4a-5a4e-4b8e-9d3f-0d1e2f3a4b5c\n"
CLOUDIMG_CONSOLE = ["console=tty1", "console=ttyS0"]
# An image prepared the way cloud-image guides advise ("do not edit GRUB_CMDLINE_LINUX_DEFAULT,
# append to it in grub.d"): the IOMMU parameter is already there, in DEFAULT, before tpuboot.cfg.
IOMMU_APPENDED = 'GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT intel_iommu=on,sm_on"\n'


@pytest.fixture
def cloudimg_drop_ins(vm: VM) -> Iterator[dict[str, str]]:
    """Ubuntu's cloud-image drop-ins in the guest's /etc/default/grub.d, removed afterwards."""
    files = {
        "/etc/default/grub.d/40-force-partuuid.cfg": FORCE_PARTUUID,
        "/etc/default/grub.d/50-cloudimg-settings.cfg": CLOUDIMG_SETTINGS,
    }
    for path, text in files.items():
        vm.write_file(path, text)
    yield files
    vm.run(["rm", "-f", *files, "/etc/default/grub.d/60-tpu-iommu.cfg"], check=True)


def test_grub_with_ubuntu_cloud_image_drop_ins(vm: VM, cloudimg_drop_ins: dict[str, str]) -> None:
    """tpuboot.cfg sorts after them: their console stays, each TPU parameter is there once."""
    lines = kernel_lines(vm)
    for line in lines:
        assert_each_tpu_parameter_once(line)
    # GRUB_CMDLINE_LINUX_DEFAULT goes to the normal entries only, not to recovery ones.
    normal = [line for line in lines if "single" not in line and "recovery" not in line]
    assert normal, lines
    for line in normal:
        assert [word for word in line if word.startswith("console=")] == CLOUDIMG_CONSOLE, " ".join(line)


def test_grub_parameter_already_in_the_default_cmdline_is_not_repeated(
    vm: VM, cloudimg_drop_ins: dict[str, str]
) -> None:
    vm.write_file("/etc/default/grub.d/60-tpu-iommu.cfg", IOMMU_APPENDED)
    normal = [line for line in kernel_lines(vm) if "single" not in line and "recovery" not in line]
    for line in normal:
        assert_each_tpu_parameter_once(line)
        assert line[-3:] == [*CLOUDIMG_CONSOLE, "intel_iommu=on,sm_on"], " ".join(line)


def test_upgrade_keeps_the_admins_conffile_edits(vm: VM) -> None:
    vm.run(["sh", "-c", f"printf '{ADMIN_EDIT}' >> /etc/tpuboot/tpuboot.yaml"], check=True)
    edited = vm.read_file("/etc/tpuboot/tpuboot.yaml")
    sh(vm, "DEBIAN_FRONTEND=noninteractive apt-get install -y /root/tpuboot-next.deb", 300)
    assert "+next1" in sh(vm, "dpkg-query -W -f '${Version}' tpuboot")
    assert vm.read_file("/etc/tpuboot/tpuboot.yaml") == edited
    vm.wait_until("systemctl is-active -q tpuboot", timeout=60)  # restarted by the upgrade


def test_boot_adds_only_the_keys_the_admin_did_not_set(vm: VM) -> None:
    """Before: tpuboot replaced the admin's CLOUDSDK_PYTHON and GCS_RESOLVE_REFRESH_SECS at boot."""
    assert sh(vm, "cat /etc/environment") == ADMIN_ENVIRONMENT + "".join(
        f"{line}\n" for line in TPUBOOT_LINES
    )
    journal = sh(vm, "journalctl -b -u tpuboot -o cat --no-pager")
    assert "kept the admin's CLOUDSDK_PYTHON='/opt/python3.11/bin/python3'" in journal


def test_purge_leaves_nothing_behind(vm: VM) -> None:
    """And the admin's /etc/environment exactly as the admin left it (before: purge deleted the
    admin's values where tpuboot had replaced them, or where the admin repeated tpuboot's line)."""
    files = [f for f in sh(vm, "dpkg -L tpuboot").splitlines() if f.strip()]
    conffiles = sh(vm, "dpkg-query -W -f '${Conffiles}' tpuboot").split()[::2]
    # The admin edits tpuboot's READ line, repeats its METADATA line (as the documented
    # configure-gcs-timeouts.sh does at every boot) and adds a line of their own; tpuboot restarts.
    sh(
        vm,
        "sed -i 's/^GCS_READ_REQUEST_TIMEOUT_SECS=300$/GCS_READ_REQUEST_TIMEOUT_SECS=900/' /etc/environment"
        " && printf 'GCS_METADATA_REQUEST_TIMEOUT_SECS=300\\nADMIN_SETTING=kept\\n' >> /etc/environment"
        " && printf 'vfio: {retries: 5}\\n' >> /etc/tpuboot/tpuboot.yaml"  # a key set: PyYAML reads it
        " && systemctl restart tpuboot",
        180,
    )
    # tpuboot's METADATA line yielded to the admin's; the admin's edit stood.
    restarted = [
        *ADMIN_ENVIRONMENT.splitlines(),
        "GCS_REQUEST_CONNECTION_TIMEOUT_SECS=300",
        "GCS_READ_REQUEST_TIMEOUT_SECS=900",
        "GCS_WRITE_REQUEST_TIMEOUT_SECS=600",
        "GCS_METADATA_REQUEST_TIMEOUT_SECS=300",
        "ADMIN_SETTING=kept",
    ]
    assert sh(vm, "cat /etc/environment").splitlines() == restarted
    # After tpuboot's last run, the admin repeats its WRITE line too: purge removes one of the two.
    sh(vm, "echo GCS_WRITE_REQUEST_TIMEOUT_SECS=600 >> /etc/environment")
    admins = sh(vm, "cat /etc/environment").replace("GCS_REQUEST_CONNECTION_TIMEOUT_SECS=300\n", "", 1)
    admins = admins.replace("GCS_WRITE_REQUEST_TIMEOUT_SECS=600\n", "", 1)
    sh(vm, "DEBIAN_FRONTEND=noninteractive apt-get purge -y tpuboot", 300)
    assert sh(vm, "cat /etc/environment") == admins  # ours gone, every admin value as it was
    assert admins.startswith(ADMIN_ENVIRONMENT) and admins.count("=") == 6
    leftovers = vm.run(["python3", "-c", LIST_FILES, *files, *conffiles]).stdout.split()
    assert leftovers == []
    for path in (
        "/var/lib/tpuboot",
        "/var/cache/tpuboot",
        "/run/tpuboot",
        "/etc/tpuboot",
        "/home/tpu-runtime/tpu-env",
    ):
        assert vm.run(["test", "-e", path]).rc == 1, path
    assert vm.run(["test", "-L", "/etc/systemd/system/multi-user.target.wants/tpuboot.service"]).rc == 1
    assert sh(vm, "systemctl is-active tpuboot || true").strip() == "inactive"
    assert login_limits(vm)[0] != "unlimited"
    sh(vm, "grub-mkconfig -o /tmp/grub.cfg 2>/dev/null", timeout=180)
    assert "idle=poll" not in sh(vm, "cat /tmp/grub.cfg")
