"""READY that waits for every TPU present at boot, and this host's state in guest attributes.

One Debian 12 guest with the .deb and the in-guest metadata emulator (guest attributes on:
``enable-guest-attributes: 'TRUE'`` among its instance attributes). Its stand-ins: three edu
devices on the root complex, and one edu behind a PCIe-to-PCI bridge that shares its IOMMU group
with a virtio-rng (not a stand-in here) held by virtio-pci at boot. That edu's bind fails as the
kernel has it (the group is not viable, a transient failure) until a guest unit releases the
virtio-rng, a few seconds after tpuboot's first failure: READY must wait for the retry that binds
it. Each test needs only the boot; the one that turns guest attributes off puts them back.
The same guest hears maintenance, then a preemption, from its emulator (the last test): a hook
in /etc/tpuboot/maintenance.d writes a file as a job's checkpoint would, and the guest's own
`tpuboot wait-maintenance` sees each notice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import GUEST_LIBEXEC, Artifacts, in_tree
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    EDU,
    MDS_PORT,
    READY_STATUS,
    STAND_INS,
    VIRTIO_RNG,
    enable_unit,
    package_install_hook,
    write_in_tree,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

EDU_ONLY = [s for s in STAND_INS if (s["vendor"], s["device"]) == EDU]
CONFIG = yaml.safe_dump({"devices": EDU_ONLY, "vbar": {"enabled": False}}, sort_keys=False)
ATTRIBUTES = {"tpu-env": SAMPLE_TPU_ENV, "enable-guest-attributes": "TRUE"}
MDS = f"http://127.0.0.1:{MDS_PORT}"
RELEASED = "/run/tpuboot-test-released"
ENABLE = "/_emulator/v1/instance/attributes/enable-guest-attributes"

# Waits for tpuboot's first "not viable" failure, then releases the virtio-rng after 4 s.
RELEASE_SCRIPT = f"""#!/bin/sh
until journalctl -b -u tpuboot -q -o cat | grep -q 'is not viable'; do sleep 0.5; done
sleep 4
for d in /sys/bus/pci/devices/*; do
    if [ "$(cat $d/vendor)" = {VIRTIO_RNG[0]:#06x} ] && [ "$(cat $d/device)" = {VIRTIO_RNG[1]:#06x} ] \\
            && [ -e $d/driver ]; then
        at=$(cut -d' ' -f1 /proc/uptime)  # before the unbind: READY may follow it within ms
        echo "${{d##*/}}" > $d/driver/unbind
        echo "$at" > {RELEASED}
        echo "released ${{d##*/}} from virtio-pci"
    fi
done
"""
RELEASE_UNIT = f"""[Unit]
Description=Release the virtio-rng sharing a stand-in's IOMMU group (tpuboot tests)
DefaultDependencies=no
After=local-fs.target systemd-journald.service
# Started with tpuboot, never after it: tpuboot's READY waits for this release.
Before=tpuboot.service

[Service]
Type=simple
ExecStart=/bin/sh {GUEST_LIBEXEC}/release-rng

[Install]
WantedBy=multi-user.target
"""
# GET or PUT on the guest's metadata emulator, printing "STATUS BODY" (stdlib only). Not named
# http.py: the emulator beside it would import it for the standard library's http package.
HTTP_SCRIPT = """
import sys, urllib.error, urllib.request
method, url = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else None
request = urllib.request.Request(url, data, {"Metadata-Flavor": "Google"}, method=method)
try:
    with urllib.request.urlopen(request, timeout=10) as answer:
        print(answer.status, answer.read().decode())
except urllib.error.HTTPError as error:
    print(error.code, error.read().decode())
"""


# The job's checkpoint, as a notice hook writes it: root's, 0755, in the shipped directory.
CHECKPOINT = "/run/tpuboot/checkpoint"
HOOK = f"""#!/bin/sh
echo "$TPUBOOT_NOTICE_KIND $TPUBOOT_NOTICE_VALUE $1" >> {CHECKPOINT}
"""
NOTICE_CONTROL = "/_emulator/v1/instance/"


def install(deb: Path) -> Callable[[Path], None]:
    base = package_install_hook(deb, CONFIG)

    def hook(tree: Path) -> None:
        base(tree)
        write_in_tree(tree, "/etc/tpuboot-test/attributes.yaml", yaml.safe_dump(ATTRIBUTES, sort_keys=False))
        write_in_tree(tree, f"{GUEST_LIBEXEC}/release-rng", RELEASE_SCRIPT)
        write_in_tree(tree, f"{GUEST_LIBEXEC}/mds-request", HTTP_SCRIPT)
        write_in_tree(tree, "/etc/tpuboot/maintenance.d/10-checkpoint", HOOK, mode=0o755)
        write_in_tree(tree, "/etc/systemd/system/tpuboot-test-release.service", RELEASE_UNIT)
        enable_unit(tree, "tpuboot-test-release.service", "/etc/systemd/system")
        for unit in ("docker.service", "docker.socket", "containerd.service"):  # vBar is off here:
            mask = in_tree(tree, f"/etc/systemd/system/{unit}")  # 100 s less of boot under TCG
            mask.parent.mkdir(parents=True, exist_ok=True)
            if not mask.is_symlink():
                os.symlink("/dev/null", mask)

    return hook


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    image = vm_image_factory(install(tpuboot_deb), key="tpuboot-guestattrs")
    devices = [
        "edu",
        "edu",
        "edu",
        "pcie-pci-bridge,id=br0",
        "edu,bus=br0,addr=1",
        "virtio-rng-pci,bus=br0,addr=2",
    ]
    with VM.from_artifacts(vm_artifacts, image, devices=devices, name="guestattrs") as m:
        m.wait_booted()
        yield m


def http(vm: VM, method: str, path: str, data: str | None = None) -> tuple[int, str]:
    argv = ["python3", f"{GUEST_LIBEXEC}/mds-request", method, MDS + path] + (
        [data] if data is not None else []
    )
    status, _, body = vm.run(argv, check=True).stdout.rstrip("\n").partition(" ")
    return int(status), body


def guest_attribute(vm: VM, key: str) -> tuple[int, str]:
    return http(vm, "GET", f"/computeMetadata/v1/instance/guest-attributes/tpuboot/{key}")


def show(vm: VM, prop: str, unit: str = "tpuboot") -> str:
    return vm.run(["systemctl", "show", "-P", prop, unit], check=True).stdout.strip()


def test_the_stand_in_behind_the_bridge_shares_its_group_with_the_held_device(vm: VM) -> None:
    (rng,) = vm.pci_devices(*VIRTIO_RNG)
    behind = [d for d in vm.pci_devices(*EDU) if d.iommu_group == rng.iommu_group]
    assert len(behind) == 1, "QEMU did not put the bridged edu in the virtio-rng's IOMMU group"


def test_ready_waited_for_the_retry_that_bound_the_last_tpu(vm: VM) -> None:
    vm.wait_until(f"test -s {RELEASED}", timeout=120)
    vm.wait_until("systemctl is-active -q tpuboot", timeout=120)
    assert show(vm, "StatusText") == READY_STATUS
    released = float(vm.read_file(RELEASED).decode())
    ready = int(show(vm, "ActiveEnterTimestampMonotonic")) / 1e6
    assert ready > released, f"READY at {ready:.1f} s, before the release at {released:.1f} s"
    journal = vm.run(["journalctl", "-b", "-u", "tpuboot", "-o", "cat"], check=True).stdout
    failed_first = journal.index("is not viable")
    assert "(retry 1/5 in 1 s)" in journal
    assert failed_first < journal.index("ready: " + READY_STATUS)
    print(f"released at {released:.1f} s, READY at {ready:.1f} s (since boot)")


def test_the_state_is_read_back_from_the_guest_attributes(vm: VM) -> None:
    # The first write of each key came at start; the next is due min_interval (60 s) later.
    state = f"{MDS}/computeMetadata/v1/instance/guest-attributes/tpuboot/state"
    vm.wait_until(
        f"python3 {GUEST_LIBEXEC}/mds-request GET {state} | grep -qx '200 ready'",
        timeout=150,
        interval=1.0,
    )
    # With the TPUs' PCIe state (read in the daemon's tick: the stand-ins have no AER or link trouble).
    tpus = f"{MDS}/computeMetadata/v1/instance/guest-attributes/tpuboot/tpus"
    vm.wait_until(
        f"python3 {GUEST_LIBEXEC}/mds-request GET {tpus} | grep -qx '200 bound=4 expected=4 failed=0 pcie=ok'",  # noqa: E501
        timeout=150,
        interval=1.0,
    )
    status, env = guest_attribute(vm, "tpu-env")
    assert status == 200 and env.startswith("source=metadata keys=14 updated=20"), env
    assert guest_attribute(vm, "vbar") == (200, "disabled")
    version = vm.run(["tpuboot", "--version"], check=True).stdout.split()[-1]
    assert guest_attribute(vm, "version") == (200, version)
    assert http(vm, "GET", "/computeMetadata/v1/instance/guest-attributes/tpuboot/")[1].split() == [
        "notice", "state", "tpu-env", "tpus", "vbar", "version"
    ]  # fmt: skip
    assert guest_attribute(vm, "notice") == (200, "none")


def stats(vm: VM) -> dict[str, int]:
    return json.loads(http(vm, "GET", "/_emulator/stats")[1])


def test_a_stop_publishes_stopped_and_nothing_is_published_when_disabled(vm: VM) -> None:
    vm.run(["systemctl", "stop", "tpuboot"], check=True, timeout=60)
    try:
        assert guest_attribute(vm, "state") == (200, "stopped")
        assert http(vm, "PUT", ENABLE, "FALSE")[0] == 200
        writes = stats(vm)["guest_attribute_writes"]
        vm.run(["systemctl", "start", "tpuboot"], check=True, timeout=90)
        assert show(vm, "StatusText") == READY_STATUS
        vm.wait_until(
            "journalctl -b -u tpuboot -q -o cat | grep -q "
            "\"guest attributes: not published (enable-guest-attributes='FALSE' on the instance)\"",
            timeout=30,
        )
        vm.run(["sleep", "3"])
        assert stats(vm)["guest_attribute_writes"] == writes
        assert guest_attribute(vm, "state") == (403, "Guest attributes endpoint access is disabled.")
    finally:  # on again, tpuboot running (a no-op when it is), for whatever runs after
        http(vm, "PUT", ENABLE, "TRUE")
        vm.run(["systemctl", "start", "tpuboot"], check=True, timeout=90)


def test_maintenance_then_preemption_reach_the_hook_the_job_and_status(vm: VM) -> None:
    """The emulator announces TERMINATE_ON_HOST_MAINTENANCE, then a preemption: each time the
    guest's own `tpuboot wait-maintenance` returns with it and the hook writes its checkpoint
    line (each waited for as an event of its own: the file is written before the hooks run)."""
    vm.wait_until("systemctl is-active -q tpuboot", timeout=120)
    vm.wait_until("test -s /run/tpuboot/notice", timeout=60)
    assert vm.run(["tpuboot", "wait-maintenance", "--check"]).rc == 1  # quiet so far
    try:
        assert (
            http(vm, "PUT", NOTICE_CONTROL + "maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")[0] == 200
        )
        told = vm.run(["tpuboot", "wait-maintenance", "--kind", "maintenance", "--timeout", "60"], timeout=90)
        assert (told.rc, told.stdout) == (0, "maintenance TERMINATE_ON_HOST_MAINTENANCE\n")
        vm.wait_until(
            f"grep -qx 'maintenance TERMINATE_ON_HOST_MAINTENANCE maintenance' {CHECKPOINT}", timeout=30
        )
        assert http(vm, "PUT", NOTICE_CONTROL + "preempted", "TRUE")[0] == 200
        told = vm.run(["tpuboot", "wait-maintenance", "--kind", "preempted", "--timeout", "60"], timeout=90)
        assert (told.rc, told.stdout) == (0, "preempted TRUE\n")
        vm.wait_until(f"grep -qx 'preempted TRUE preempted' {CHECKPOINT}", timeout=30)
        both = "preempted: shutting down; host maintenance now (terminate)"
        vm.wait_until(f"systemctl show -P StatusText tpuboot | grep -q '{both}'", timeout=30)
        journal = vm.run(["journalctl", "-b", "-u", "tpuboot", "-o", "cat"], check=True).stdout
        assert "notice hook 10-checkpoint: exit status 0" in journal
        fields = vm.run(
            ["journalctl", "-b", "-u", "tpuboot", "NOTICE_KIND=preempted", "-o", "cat"], check=True
        )
        assert "notice: preempted TRUE" in fields.stdout
        doctor = vm.run(["tpuboot", "doctor", "--json"], timeout=120).stdout
        (check,) = [c for c in json.loads(doctor) if c["name"] == "maintenance-notice"]
        assert check["status"] == "WARN" and "preempted TRUE" in check["detail"]
    finally:  # quiet again, for whatever runs after
        http(vm, "PUT", NOTICE_CONTROL + "maintenance-event", "NONE")
        http(vm, "PUT", NOTICE_CONTROL + "preempted", "FALSE")
