"""`tpuboot doctor` and the metrics endpoint in a guest installed from the .deb.

The good image passes every check except those the bench cannot satisfy (``BENCH_FAILS``: two
stand-ins where the accelerator type in the emulator's tpu-env implies 4 chips; no network for
vBar's image). Then each deliberately broken setting, one at a time and put back afterwards,
fails exactly the matching check(s). The kernel parameter case does not reboot (costly under
TCG): a doctored copy of /proc/cmdline is bind-mounted over it in the guest. With vBar and the
telemetry collector enabled and the guest's dockerd stopped, each is a FAIL naming how to start it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import DOCTOR_ENV, KERNEL_PARAMS, SCRAPE, wait_bound_with_tpu_env

pytestmark = pytest.mark.vm

# The emulator's tpu-env says v5p-8 (4 chips) and the bench has 2 stand-ins; vBar's image cannot
# be pulled without a network.
BENCH_FAILS = {"chip-count", "vbar-running"}
MUST_PASS = {
    "tpus-bound",
    "vfio-pci-loaded",
    "vfio-node-mode",
    "unsafe-interrupts",
    "iommu-groups-viable",
    "slice",
    "cmdline-idle-poll",
    "cmdline-transparent-hugepage",
    "cmdline-intel-iommu",
    "thp-enabled",
    "pam-memlock",
    "pam-nofile",
    "systemd-default-limits",
    "accel-udev-rule",
    "tpu-env",
    "tpu-env-fresh",
    "environment",
}
# The documented rule's last line (the tagging lines before it match no stand-in anyway).
LEFTOVER_RULE = 'TAG=="bind_to_vfio_pci", RUN+="/lib/udev/bind_to_vfio_pci.sh $kernel"'
LIMITS = "/etc/security/limits.d/tpuboot.conf"


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, tpuboot_image: Path) -> Iterator[VM]:
    with VM.from_artifacts(
        vm_artifacts,
        tpuboot_image,
        devices=["edu", "edu"],
        cmdline_extra=" ".join(KERNEL_PARAMS),
        name="doctor",
    ) as machine:
        machine.wait_booted()
        wait_bound_with_tpu_env(machine, 2)
        yield machine


@pytest.fixture(scope="module")
def good(vm: VM) -> tuple[int, dict[str, dict[str, object]]]:
    """The doctor's report on the good image (each run costs seconds under TCG: taken once)."""
    return doctor(vm)


def doctor(vm: VM, *options: str) -> tuple[int, dict[str, dict[str, object]]]:
    result = vm.run(["tpuboot", *options, "doctor", "--json"], env=DOCTOR_ENV, timeout=90)
    assert result.rc in (0, 1), result.stdout + result.stderr
    return result.rc, {r["name"]: r for r in json.loads(result.stdout)}


def failing(report: dict[str, dict[str, object]]) -> set[str]:
    """The required checks that fail (an advisory one, such as Debian 12's Docker 20.10 reading no
    CDI specs, is shown but leaves the exit status alone)."""
    return {name for name, r in report.items() if r["status"] == "FAIL" and r["required"]}


def tpus(vm: VM) -> list[dict[str, object]]:
    return json.loads(vm.run(["tpuboot", "status", "--json"], check=True).stdout)


def test_good_image_passes_all_but_the_bench_limits(
    vm: VM, good: tuple[int, dict[str, dict[str, object]]]
) -> None:
    rc, report = good
    assert failing(report) <= BENCH_FAILS, {n: report[n] for n in failing(report)}
    assert {n for n in MUST_PASS if report[n]["status"] != "PASS"} == set(), report
    assert rc == (1 if failing(report) else 0)
    text = vm.run(["tpuboot", "doctor"], env=DOCTOR_ENV, timeout=90).stdout.splitlines()
    assert len(text) == len(report)
    assert all(line.split()[0] in ("PASS", "FAIL", "SKIP", "WARN") for line in text)
    assert report["slice"]["detail"] == "v5p-8, 4 chips in 2x2x1, 1 host of 4 chips, this host is worker 0"
    assert all(" fix: " in line for line in text if line.startswith("FAIL"))


def test_the_daemon_serves_metrics_on_loopback(vm: VM) -> None:
    body = vm.run(["python3", "-c", SCRAPE], check=True).stdout
    assert 'tpuboot_build_info{version="' in body
    bound = [
        line for line in body.splitlines() if line.startswith("tpuboot_tpus{") and 'state="bound"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in bound) == 2, body
    assert 'tpuboot_bind_attempts_total{result="bound"} 2.0' in body
    assert "tpuboot_tpu_env_from_cache 0.0" in body
    assert 'tpuboot_metadata_requests_total{outcome="ok"}' in body


def newly_failing(vm: VM, baseline: set[str]) -> set[str]:
    return failing(doctor(vm)[1]) - baseline


def test_each_broken_setting_fails_exactly_its_check(
    vm: VM, good: tuple[int, dict[str, dict[str, object]]]
) -> None:
    baseline = failing(good[1])
    first = tpus(vm)[0]
    address, group = first["address"], first["iommu_group"]

    # A device unbound.
    vm.run(["tpuboot", "unbind", address], check=True)
    try:
        assert newly_failing(vm, baseline) == {"tpus-bound"}
    finally:
        vm.run(["tpuboot", "bind", address], check=True)

    # Its /dev/vfio node at 0600.
    vm.run(["chmod", "0600", f"/dev/vfio/{group}"], check=True)
    try:
        assert newly_failing(vm, baseline) == {"vfio-node-mode"}
    finally:
        vm.run(["chmod", "0666", f"/dev/vfio/{group}"], check=True)

    # The limits file missing: both PAM limits come from it.
    vm.run(["mv", LIMITS, "/root/limits.conf.away"], check=True)
    try:
        assert newly_failing(vm, baseline) == {"pam-memlock", "pam-nofile"}
    finally:
        vm.run(["mv", "/root/limits.conf.away", LIMITS], check=True)

    # The documented procedure's udev rule left in the image: a second vfio binder, named.
    rule = "/etc/udev/rules.d/99-tpu-vfiopci.rules"
    vm.run(f"printf '%s\\n' {shlex.quote(LEFTOVER_RULE)} > {rule}", check=True)
    try:
        report = doctor(vm)[1]
        assert failing(report) - baseline == {"leftover-vfio-binder"}
        leftover = report["leftover-vfio-binder"]
        assert str(leftover["detail"]).endswith(f"{rule} (/lib/udev/bind_to_vfio_pci.sh)"), leftover
        assert leftover["fix"] == f"remove {rule}: tpuboot binds TPUs itself", leftover
    finally:
        vm.run(["rm", "-f", rule], check=True)

    # A kernel parameter missing: a doctored /proc/cmdline bind-mounted over the real one.
    vm.run(
        "sed 's/ idle=poll//' /proc/cmdline > /run/cmdline && mount --bind /run/cmdline /proc/cmdline",
        check=True,
    )
    try:
        assert "idle=poll" not in vm.run(["cat", "/proc/cmdline"], check=True).stdout
        assert newly_failing(vm, baseline) == {"cmdline-idle-poll"}
    finally:
        vm.run(["umount", "/proc/cmdline"], check=True)


def test_no_dockerd_where_the_agents_are_needed_fails_with_the_fix(vm: VM) -> None:
    """vBar and the collector on, not GKE, the guest's dockerd stopped (its socket unit too): each
    is a FAIL naming how to start dockerd, which is installed. (Containers that are absent or
    stopped under a dockerd that answers: tests/unit/checks/test_doctor.py, against the fake dockerd.)"""
    agents = "{gke: 'false', vbar: {enabled: true}, telemetry: {enabled: true}}\n"
    vm.run(f"printf %s {shlex.quote(agents)} > /run/doctor-agents.yaml", check=True)
    vm.run(["systemctl", "stop", "docker.socket", "docker.service"], check=True, timeout=120)
    try:
        report = doctor(vm, "--config", "/run/doctor-agents.yaml")[1]
    finally:
        vm.run(["systemctl", "start", "--no-block", "docker"], check=True)
    for name in ("vbar-running", "telemetry-running"):
        assert report[name]["status"] == "FAIL", report[name]
        assert str(report[name]["detail"]).startswith("dockerd does not answer ("), report[name]
        assert str(report[name]["fix"]).startswith("systemctl enable --now docker"), report[name]
