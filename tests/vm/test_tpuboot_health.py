"""Chip health and recovery on a real kernel: a stand-in TPU behind a PCIe root port with QEMU's
AER capability, errors injected through QMP, the reset ladder on the real device, the boot budget.

What QEMU can stand in for, and what not: a virtio-rng stand-in on a ``pcie-root-port`` with
``aer=on`` has a real PCIe capability (link files, AER counters the kernel keeps, FLR, PM and bus
reset methods); ``pcie_aer_inject_error`` makes the kernel's AER driver count a real non-fatal or
fatal error. QEMU 7.2's endpoints always train at their own maximum (2.5 GT/s x1), whatever the
root port's ``x-speed``/``x-width``, so a degraded link cannot be emulated: its judgement is tested
on sysfs trees (tests/unit/devices/test_health.py), the real files' format here.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    DOCTOR_ENV,
    KERNEL_PARAMS,
    SCRAPE,
    STAND_INS,
    VFIO_READ,
    VIRTIO_RNG,
    wait_bound_with_tpu_env,
)

pytestmark = pytest.mark.vm

# More resets than the default breaker allows in an hour: this test climbs the ladder several times.
RESET_CONFIG = "/run/tpuboot-reset.yaml"
RESET_CONFIG_TEXT = json.dumps(
    {"devices": STAND_INS, "vbar": {"enabled": False}, "recovery": {"max_resets_per_hour": 10}}
)


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, tpuboot_image: Path) -> Iterator[VM]:
    with VM.from_artifacts(
        vm_artifacts,
        tpuboot_image,
        devices=[
            "pcie-root-port,id=hr1,chassis=6,slot=1",
            "virtio-rng-pci,bus=hr1,id=rng1,aer=on,disable-legacy=off",  # transitional: 1af4:1005
            "pcie-root-port,id=hr2,chassis=6,slot=2",
            "edu,bus=hr2,id=edu1",
        ],
        cmdline_extra=" ".join(KERNEL_PARAMS),
        name="health",
    ) as machine:
        machine.wait_booted()
        wait_bound_with_tpu_env(machine, 2)
        machine.write_file(RESET_CONFIG, RESET_CONFIG_TEXT.encode())
        yield machine


def status(vm: VM) -> dict[str, dict[str, object]]:
    result = vm.run(["tpuboot", "status", "--json"], timeout=60)
    assert result.rc in (0, 1), result.stdout + result.stderr
    return {t["address"]: t for t in json.loads(result.stdout)}


def rng(vm: VM) -> str:
    (device,) = vm.pci_devices(*VIRTIO_RNG)
    return device.address


def doctor_pcie(vm: VM) -> dict[str, object]:
    result = vm.run(["tpuboot", "doctor", "--json"], env=DOCTOR_ENV, timeout=120)
    return next(r for r in json.loads(result.stdout) if r["name"] == "pcie-health")


def inject(vm: VM, error: str) -> None:
    """One AER error on the stand-in, as a device would report it (QEMU's HMP command)."""
    answer = vm.qmp("human-monitor-command", **{"command-line": f"pcie_aer_inject_error rng1 {error}"})
    assert "OK" in str(answer), answer


def total(vm: VM, address: str, kind: str) -> int:
    text = vm.run(["cat", f"/sys/bus/pci/devices/{address}/aer_dev_{kind}"], check=True).stdout
    match = re.search(r"^TOTAL_ERR_\w+ (\d+)$", text, re.M)
    assert match, text
    return int(match[1])


def reset(vm: VM, address: str, *options: str) -> tuple[int, str]:
    result = vm.run(["tpuboot", "--config", RESET_CONFIG, "reset", *options, address], timeout=180)
    return result.rc, result.stdout + result.stderr


def readable(vm: VM, address: str) -> bool:
    """The unprivileged proof: the tester opens the chip through VFIO and reads BAR0."""
    return vm.run([VFIO_READ, address], user="tester", timeout=60).rc == 0


def test_status_and_metrics_show_the_real_pcie_state(vm: VM) -> None:
    address = rng(vm)
    pcie = status(vm)[address]["pcie"]
    assert pcie["present"] is True
    assert pcie["link"]["fraction"] == 1.0 and pcie["link"]["max_width"] >= 1
    assert pcie["aer_totals"] == {"correctable": 0, "nonfatal": 0, "fatal": 0}
    assert "flr" in pcie["reset_methods"]
    body = vm.run(["python3", "-c", SCRAPE], check=True).stdout
    assert f'tpuboot_pcie_present{{address="{address}",chip="{address[:-2]}"}} 1.0' in body
    assert f'tpuboot_pcie_errors_total{{address="{address}",chip="{address[:-2]}",kind="fatal"}} 0.0' in body
    assert 'tpuboot_boot_phase_seconds{phase="ready"}' in body
    assert doctor_pcie(vm)["status"] == "PASS"


def test_the_boot_budget_is_in_the_journal_and_in_status_boot(vm: VM) -> None:
    entries = [
        json.loads(line)
        for line in vm.run(
            ["journalctl", "-u", "tpuboot", "-b", "-o", "json"], check=True
        ).stdout.splitlines()
    ]
    (budget,) = [e for e in entries if str(e.get("MESSAGE", "")).startswith("boot budget: ")]
    for field in ("MONITOR_OPEN", "COLDPLUG_ENUMERATED", "TPU_ENV_WRITTEN", "READY", "STARTED_AFTER_KERNEL"):
        assert float(budget[f"TPUBOOT_BOOT_{field}"]) >= 0, budget
    assert len(budget["TPUBOOT_BOOT_BINDS"].split()) == 2, budget
    shown = vm.run(["tpuboot", "status", "--boot"], check=True).stdout
    assert "s after the kernel" in shown and shown.rstrip().endswith("ready"), shown


def test_injected_aer_errors_show_in_metrics_and_doctor(vm: VM) -> None:
    address = rng(vm)
    inject(vm, "POISON_TLP")  # uncorrectable, non-fatal by default severity
    vm.wait_until(
        f"grep -q '^TOTAL_ERR_NONFATAL [1-9]' /sys/bus/pci/devices/{address}/aer_dev_nonfatal", timeout=30
    )
    check = doctor_pcie(vm)
    assert check["status"] == "WARN" and f"{address} logged" in str(check["detail"]), check
    body = vm.run(["python3", "-c", SCRAPE], check=True).stdout
    assert f'kind="nonfatal"}} {float(total(vm, address, "nonfatal"))}' in body
    inject(vm, "DLP")  # Data Link Protocol error: fatal by default severity
    # Linux 6.1 no longer reads the endpoint's status after a fatal error; its root port counts it.
    port = status(vm)[address]["pcie"]["root_port"]
    assert port, status(vm)[address]["pcie"]
    vm.wait_until(f"grep -q '^[1-9]' /sys/bus/pci/devices/{port}/aer_rootport_total_err_fatal", timeout=30)
    check = doctor_pcie(vm)
    assert check["status"] == "FAIL" and "fatal PCIe error" in str(check["detail"]), check
    assert f"as its root port {port} received them" in str(check["detail"]), check
    assert vm.run(["tpuboot", "status"], timeout=60).rc == 1


AUTOMATIC_CONFIG = json.dumps(
    {
        "devices": STAND_INS,
        "vbar": {"enabled": False},
        "recovery": {"automatic": True, "max_resets_per_hour": 10},
    }
)


def since(vm: VM, cursor: str) -> str:
    return vm.run(["journalctl", "-u", "tpuboot", f"--after-cursor={cursor}", "-o", "cat"], check=True).stdout


def test_recovery_automatic_resets_a_chip_after_a_fatal_error_but_never_while_held(vm: VM) -> None:
    """recovery.automatic on (the daemon as the unit runs it, sandbox and all): a fatal error on a
    held chip is left alone, named with its holder (seen through the sandbox); once the holder
    ends, the next tick climbs the ladder and the chip is back, its error history. Before the
    ladder test: after a remove and rescan, Linux 6.1 leaves the new function's error reporting
    off, and an injected error would not reach the root port. The holder comes first, so the
    fatal error the test before left cannot be reset before it holds."""
    address = rng(vm)
    chip = address[:-2]
    group = status(vm)[address]["iommu_group"]
    shipped = vm.run(["cat", "/etc/tpuboot/tpuboot.yaml"], check=True).stdout
    cursor = vm.run(["journalctl", "-u", "tpuboot", "-n", "0", "--show-cursor"], check=True).stdout
    cursor = cursor.strip().rpartition("-- cursor: ")[2]
    holder = f"import time; f = open('/dev/vfio/{group}', 'rb', buffering=0); time.sleep(600)"
    vm.run(f"setsid python3 -c {shlex.quote(holder)} >/dev/null 2>&1 &", user="tester", check=True)
    try:
        vm.wait_until("! tpuboot who >/dev/null", timeout=30, interval=0.5)
        vm.write_file("/etc/tpuboot/tpuboot.yaml", AUTOMATIC_CONFIG)
        vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=180)
        wait_bound_with_tpu_env(vm, 2)
        inject(vm, "DLP")  # fatal, besides the one the test before injected
        held = f"chip {chip}: {address} logged "
        vm.wait_until(
            f"journalctl -u tpuboot --after-cursor={shlex.quote(cursor)} -o cat | grep -F '{held}' "
            "| grep -q 'not reset while it may be held: PID'",
            timeout=90,
            interval=2.0,
        )
        assert "resetting it" not in since(vm, cursor)
        vm.run(["pkill", "-u", "tester", "-f", "/dev/vfio/"], check=True)
        vm.wait_until(
            f"journalctl -u tpuboot --after-cursor={shlex.quote(cursor)} -o cat | grep -q 'brought it back'",
            timeout=120,
            interval=2.0,
        )
        journal = since(vm, cursor)
        assert f"chip {chip}: " in journal and "resetting it (recovery.automatic)" in journal, journal
        assert readable(vm, address)
        assert doctor_pcie(vm)["status"] == "PASS"  # the fatal error is history after the reset
        body = vm.run(["python3", "-c", SCRAPE], check=True).stdout
        assert f'tpuboot_automatic_resets_total{{chip="{chip}",result="recovered"}} 1.0' in body
    finally:
        vm.run(["pkill", "-u", "tester", "-f", "/dev/vfio/"])
        vm.write_file("/etc/tpuboot/tpuboot.yaml", shipped)
        vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=180)


def test_reset_refuses_a_held_chip_and_kill_ends_the_holder_first(vm: VM) -> None:
    address = rng(vm)
    group = status(vm)[address]["iommu_group"]
    holder = (
        f"import time; f = open('/dev/vfio/{group}', 'rb', buffering=0); "
        "open('/tmp/held', 'w').close(); time.sleep(600)"
    )
    vm.run(
        f"rm -f /tmp/held; setsid python3 -c {shlex.quote(holder)} >/dev/null 2>&1 &",
        user="tester",
        check=True,
    )
    vm.wait_until("test -e /tmp/held", timeout=30)
    rc, out = reset(vm, address)
    assert rc == 1 and "held by" in out and "--kill" in out, out
    rc, out = reset(vm, address, "--kill")
    assert rc == 0, out
    assert "ended" in out and "brought it back" in out, out


def test_the_ladder_on_a_real_device_climbs_to_the_rung_that_works(vm: VM) -> None:
    address = rng(vm)
    rc, plan = reset(vm, address, "--dry-run")
    assert rc == 0 and "function-reset: write 1 to reset" in plan and "remove-rescan" in plan, plan
    # 1: the kernel's function reset.
    rc, out = reset(vm, address)
    assert rc == 0 and "function-reset" in out and "brought it back" in out, out
    assert readable(vm, address)
    # 2: no reset method left (an admin turned them off): the rebind rung.
    vm.run(f"echo > /sys/bus/pci/devices/{address}/reset_method", check=True)
    rc, out = reset(vm, address)
    assert rc == 0 and "function-reset" not in out and "rebind" in out and "brought it back" in out, out
    assert readable(vm, address)
    # 3: a function the kernel removed (what a surprise link-down does): found again by a rescan,
    # as a new function whose AER counters start again at zero.
    vm.run(f"echo 1 > /sys/bus/pci/devices/{address}/remove", check=True)
    vm.wait_until(f"! test -e /sys/bus/pci/devices/{address}", timeout=30)
    rc, out = reset(vm, address)
    assert rc == 0 and "remove-rescan" in out and "brought it back" in out, out
    assert readable(vm, address)
    assert total(vm, address, "fatal") == 0  # a new function; its root port's totals stay
    assert doctor_pcie(vm)["status"] == "PASS"  # the errors before the reset are history
