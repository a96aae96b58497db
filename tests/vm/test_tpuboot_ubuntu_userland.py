"""tpuboot's service on Ubuntu 22.04's Python and libraries, on a real kernel.

The Debian 12 guest of test_tpuboot_service.py and test_tpuboot_vbar.py (the .deb installed with
apt, dockerd with the vBar stand-in images, the metadata emulator, 3 edu devices, a virtio-rng
and a hotplug port), with one change: a drop-in points the unit's ExecStart at CPython 3.10 (the
pyenv build this machine carries, copied with a relative rpath to /opt/tpuboot-py310) whose
site-packages holds jammy's versions of tpuboot's libraries (PyYAML 5.4.1, requests 2.25.1 with
urllib3 1.26.5, pyudev 0.22.0 with six, python-systemd 234 built for 3.10, prometheus-client
0.9.0: scripts/matrix/jammy.txt) and the .deb's own tpuboot package (harness/vm/pyguest.py). One
boot serves the module; each test reads it, the hotplug test puts back what it adds, and the last
one stops the service.

What this proves: tpuboot's boot job, as the packaged systemd unit with its whole sandbox, runs on
jammy's Python minor version with jammy's libraries against a real kernel and a real dockerd:
coldplug and hotplug binds, an unprivileged VFIO read of a bound device, tpu-env written at boot
from the metadata emulator, the STATUS line (READY through python-systemd 234's sd_notify), the vBar
container started under dockerd by the supervisor, a clean stop, and no restart or traceback in the journal.

What it does not: the userland around Python is still Debian 12's. Ubuntu 22.04's systemd 249
(this guest has 252: the unit's directives are checked against 249 statically, in
tests/unit/repo/test_systemd_directives.py), Ubuntu's kernels (5.15 and 6.8, vfio-pci built in: this
kernel is Debian's 6.1 with vfio-pci a module; the built-in path is tested on sysfs trees only),
Ubuntu's docker.io 29 (this is 20.10), Ubuntu's glibc 2.35 and its patched python3.10 (3.10.12;
this is upstream 3.10.13), and Ubuntu's packaging tools (apt with Ubuntu's archive, debhelper
13.6, dh-python 5.20220403) remain unexercised.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.matrix import LIBRARIES, Row, row_named
from harness.pythons import InterpreterNotFound
from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.pyguest import PACKAGE_DIR, ensure_row_python, guest_prefix, guest_python, with_row_python
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    READY_STATUS,
    VBAR_CONTAINER,
    VBAR_IMAGE_1,
    VBAR_TPU_ENV,
    hotplug_edu,
    managed_containers,
    node_mode,
    sourced,
    stand_ins,
    status_text,
    unplug,
    vbar_guest_hook,
    vfio_read,
    wait_vbar_running,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

TPU_ENV = "/home/tpu-runtime/tpu-env"
#: The rows whose Python and libraries run tpuboot's unit. Ubuntu 24.04's (CPython 3.12 with
#: noble's versions) passed this module too (2026-12-01) but costs as much again (its own cached
#: interpreter build, one more image and a boot with dockerd): add it when the VM suite's time allows.
GUEST_ROWS = (row_named("jammy"),)
# What the emulator, the four stand-ins and a running vBar make tpuboot say.
STATUS = f"{READY_STATUS}; vBar: running"
VERSIONS = (
    "import importlib.metadata, json, sys, tpuboot; "
    "print(json.dumps({'libraries': {lib: importlib.metadata.version(lib) for lib in sys.argv[1:]}, "
    "'tpuboot': tpuboot.__file__, 'path': sys.path, 'version': sys.version.split()[0]}))"
)


@pytest.fixture(scope="module", params=GUEST_ROWS, ids=lambda r: r.name)
def row(request: pytest.FixtureRequest) -> Row:
    return request.param


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path, row: Row) -> Iterator[VM]:
    try:
        prefix = ensure_row_python(row)
    except InterpreterNotFound as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc} (CI=true: this test needs {row.system}'s Python)", pytrace=False)
        pytest.skip(str(exc))
    install = with_row_python(vbar_guest_hook(tpuboot_deb), row, prefix)
    image = vm_image_factory(install, key=f"tpuboot-{row.name}")
    devices = ["edu", "edu", "edu", "virtio-rng-pci"]
    with VM.from_artifacts(
        vm_artifacts, image, devices=devices, hotplug_ports=1, memory=1536, name=f"tpuboot-{row.name}"
    ) as m:
        m.wait_booted()
        yield m
        # The last test stopped tpuboot and looked at how: a poweroff would only cost 20 s more.
        m.kill()


def main_pid(vm: VM) -> str:
    return vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()


def test_the_unit_runs_tpuboot_on_the_rows_python(vm: VM, row: Row) -> None:
    pid = main_pid(vm)
    assert vm.run(["readlink", f"/proc/{pid}/exe"], check=True).stdout.strip() == guest_python(row)
    maps = vm.read_file(f"/proc/{pid}/maps").decode()
    assert f"{guest_prefix(row)}/lib/libpython{row.python}.so.1.0" in maps
    # python-systemd's extensions, built for this Python, are what the daemon notifies and logs with:
    abi = row.python.replace(".", "")
    loaded = set(re.findall(rf"site-packages/systemd/(_\w+)\.cpython-{abi}-x86_64-linux-gnu\.so", maps))
    assert {"_daemon", "_journal"} <= loaded, loaded


def test_the_rows_python_imports_its_systems_library_versions_and_the_packages_tpuboot(
    vm: VM, row: Row
) -> None:
    found = json.loads(vm.run([guest_python(row), "-I", "-c", VERSIONS, *LIBRARIES], check=True).stdout)
    pins = row.pins()
    assert found["libraries"] == {lib: pins[lib] for lib in LIBRARIES}
    assert found["version"].startswith(f"{row.python}.")
    assert vm.run(["realpath", found["tpuboot"]], check=True).stdout.strip() == f"{PACKAGE_DIR}/__init__.py"
    assert not [p for p in found["path"] if "dist-packages" in p]  # Debian's python3-* stay out of it


def test_vbar_runs_under_dockerd_and_the_status_line_says_all(vm: VM) -> None:
    wait_vbar_running(vm, timeout=150)
    fmt = "{{.Config.Image}} {{.HostConfig.Privileged}} {{.HostConfig.NetworkMode}}"
    shown = vm.run(["docker", "inspect", "-f", fmt, VBAR_CONTAINER], check=True, timeout=60)
    assert shown.stdout.strip() == f"{VBAR_IMAGE_1} true host"
    assert len(managed_containers(vm)) == 1
    assert status_text(vm) == STATUS


def test_coldplug_binds_all_four_stand_ins(vm: VM) -> None:
    devices = stand_ins(vm)
    assert [d.driver for d in devices] == ["vfio-pci"] * 4
    assert [node_mode(vm, d.iommu_group) for d in devices] == ["666"] * 4


def test_an_unprivileged_user_reads_each_device_through_vfio_with_the_rows_python(vm: VM, row: Row) -> None:
    """The copy of the interpreter runs for a user other than root, as the unit suite needs."""
    for edu in vm.pci_devices(*EDU):
        assert vfio_read(vm, edu.address, guest_python(row)) == EDU_ID_REGISTER


def test_a_hotplugged_device_is_bound_and_usable(vm: VM, row: Row) -> None:
    new = hotplug_edu(vm, "hot0", 0)
    try:
        assert vfio_read(vm, new.address, guest_python(row)) == EDU_ID_REGISTER
        vm.wait_until("systemctl show -P StatusText tpuboot | grep -q '^5 TPUs bound'", timeout=10)
    finally:
        unplug(vm, "hot0", 4)


def test_tpu_env_written_at_boot_sources_to_the_metadata_values(vm: VM) -> None:
    for shell in ("sh", "bash"):
        assert sourced(vm, shell, TPU_ENV) == VBAR_TPU_ENV


def test_the_service_never_restarted_stops_cleanly_and_never_raised(vm: VM) -> None:
    assert vm.run(["systemctl", "show", "-P", "NRestarts", "tpuboot"], check=True).stdout.strip() == "0"
    vm.run(["systemctl", "stop", "tpuboot"], check=True, timeout=60)
    shown = vm.run(["systemctl", "show", "-P", "Result", "tpuboot"], check=True).stdout.strip()
    assert shown == "success"  # neither its stop timeout nor a non-zero exit
    journal = vm.journal("tpuboot")
    assert "Traceback" not in journal, journal
