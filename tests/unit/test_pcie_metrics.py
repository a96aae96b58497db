"""The PCIe health metrics: read from sysfs at each scrape for TPU functions only, in Prometheus'
conventions (promtool says nothing), and gone with the function."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tpuboot import metrics, metrics_export
from tpuboot.devices.table import GOOGLE, DeviceTable

PROMTOOL = shutil.which("promtool")
TPUS = ("0000:00:04.0", "0000:00:05.0")


def sysfs(tmp_path: Path) -> FakeKernel:
    kernel = FakeKernel(tmp_path)
    for i, address in enumerate(TPUS):
        kernel.add_device(address, GOOGLE, 0x0062, (GOOGLE, 0x00AD), driver="vfio-pci", group=str(4 + i))
        d = kernel.p(f"/sys/bus/pci/devices/{address}")
        (d / "current_link_speed").write_text("16.0 GT/s PCIe\n")
        (d / "max_link_speed").write_text("16.0 GT/s PCIe\n")
        (d / "current_link_width").write_text("8\n" if i else "16\n")
        (d / "max_link_width").write_text("16\n")
        (d / "aer_dev_fatal").write_text(f"DLP {i}\nTOTAL_ERR_FATAL {i}\n")
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")  # not a TPU
    (kernel.p("/sys/bus/pci/devices/0000:00:02.0") / "aer_dev_fatal").write_text("TOTAL_ERR_FATAL 9\n")
    return kernel


@pytest.fixture
def exposed(tmp_path: Path):
    kernel = sysfs(tmp_path)
    with metrics.use(metrics.Metrics()) as m:
        metrics_export.watch_pcie(kernel.root, DeviceTable())
        yield kernel, m


def test_each_tpu_function_is_exported_with_its_chip_and_nothing_else(exposed) -> None:
    _kernel, m = exposed
    value = metrics_export.registry_of(m).get_sample_value
    for address in TPUS:
        labels = {"address": address, "chip": address[:-2]}
        assert value("tpuboot_pcie_present", labels) == 1
        assert value("tpuboot_pcie_link_width", {**labels, "link": "max"}) == 16
        assert value("tpuboot_pcie_link_speed_gigatransfers_per_second", {**labels, "link": "current"}) == 16
    assert value("tpuboot_pcie_link_bandwidth_ratio", {"address": TPUS[1], "chip": "0000:00:05"}) == 0.5
    assert (
        value("tpuboot_pcie_errors_total", {"address": TPUS[1], "chip": "0000:00:05", "kind": "fatal"}) == 1
    )
    assert b"0000:00:02.0" not in metrics_export.exposition(m)


def test_a_scrape_reads_sysfs_now(exposed) -> None:
    kernel, m = exposed
    (kernel.p(f"/sys/bus/pci/devices/{TPUS[0]}") / "config").write_bytes(b"\xff" * 64)
    kernel.remove_device(TPUS[1])
    text = metrics_export.exposition(m).decode()
    assert f'tpuboot_pcie_present{{address="{TPUS[0]}",chip="0000:00:04"}} 0.0' in text
    assert TPUS[1] not in text


def test_watching_again_replaces_the_collector(exposed) -> None:
    kernel, m = exposed
    metrics_export.watch_pcie(kernel.root, DeviceTable())  # a second daemon built on the same metrics
    assert metrics_export.exposition(m).count(b"# TYPE tpuboot_pcie_present gauge") == 1


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")
def test_promtool_finds_nothing_to_report(exposed) -> None:
    _, m = exposed
    checked = subprocess.run(
        [str(PROMTOOL), "check", "metrics"],
        input=metrics_export.exposition(m),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0 and checked.stdout == b"" and checked.stderr == b"", checked


def test_the_alert_rules_halve_where_doctor_fails() -> None:
    """One threshold: TpubootPcieLinkHalved (critical) fires where doctor's pcie-health FAILs."""
    import yaml

    from tpuboot.devices.health import FAIL_FRACTION

    rules = yaml.safe_load((Path(__file__).resolve().parents[2] / "prometheus/tpuboot.rules.yml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert exprs["TpubootPcieLinkHalved"] == f"tpuboot_pcie_link_bandwidth_ratio <= {FAIL_FRACTION}"
    assert exprs["TpubootPcieLinkDegraded"].endswith(f"> {FAIL_FRACTION}")
