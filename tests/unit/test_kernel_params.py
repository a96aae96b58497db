"""The TPU kernel parameters have one source (tpuboot/kernel_params.py). The GRUB drop-in, a shell
fragment grub-mkconfig sources, cannot import it: here sh sources the shipped file for each
architecture and must append exactly the parameters that source says that architecture needs, and
tpuboot's own reading of the drop-in (the next-boot checks) must agree with sh."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tpuboot.checks.image import run_checks
from tpuboot.checks.parsers.grub import TPUBOOT_DROPIN, next_boot
from tpuboot.devices.vfio import IOMMU_OFF_FIX
from tpuboot.kernel_params import IOMMU_PARAM, TPU_PARAMS, X86, needed
from tpuboot.paths import Root

DROPIN = Path(__file__).resolve().parents[2] / "conf/grub.d/tpuboot.cfg"
#: dpkg's answer, or None: no dpkg, so the drop-in falls back to ``uname -m``.
ARCHES = {"amd64": "amd64", "arm64": "arm64", "x86_64 (no dpkg)": None, "aarch64 (no dpkg)": None}


def sourced(dpkg_arch: str | None, uname: str) -> str:
    """GRUB_CMDLINE_LINUX after sh sources the shipped drop-in, starting empty."""
    dpkg = f"echo {dpkg_arch}" if dpkg_arch else "return 127"
    script = (
        f"dpkg() {{ {dpkg}; }}\nuname() {{ echo {uname}; }}\n"
        'GRUB_CMDLINE_LINUX=""\nGRUB_CMDLINE_LINUX_DEFAULT=""\n'
        f'. "{DROPIN}"\nprintf "%s" "$GRUB_CMDLINE_LINUX"\n'
    )
    done = subprocess.run(["sh", "-e", "-c", script], capture_output=True, text=True, check=True)
    return done.stdout


@pytest.mark.parametrize("case", sorted(ARCHES))
def test_the_grub_dropin_appends_what_the_one_source_needs(case: str) -> None:
    arch = case.split()[0]
    assert sourced(ARCHES[case], arch).split() == needed(arch)


@pytest.mark.parametrize("arch", ["amd64", "x86_64", "arm64", "aarch64"])
def test_tpuboot_reads_the_shipped_dropin_as_sh_does(tmp_path: Path, arch: str) -> None:
    (tmp_path / TPUBOOT_DROPIN.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / TPUBOOT_DROPIN.lstrip("/")).write_text(DROPIN.read_text())
    boot = next_boot(Root(tmp_path), arch)
    assert boot is not None and boot.words == needed(arch)


def test_the_iommu_parameter_is_needed_on_x86_only_and_named_by_the_fix() -> None:
    assert IOMMU_PARAM in needed("x86_64") and IOMMU_PARAM in needed("amd64")
    assert IOMMU_PARAM not in needed("aarch64")
    assert set(X86) == {"x86_64", "amd64"} and TPU_PARAMS["intel_iommu"][1] == X86
    assert IOMMU_PARAM in IOMMU_OFF_FIX


def test_the_image_check_asks_for_the_iommu_parameter(tmp_path: Path) -> None:
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/cmdline").write_text("ro\n")
    (tmp_path / "proc/sys/kernel/arch").write_text("x86_64\n")
    (found,) = run_checks(Root(tmp_path), ["cmdline-intel-iommu"])
    assert found.status == "FAIL" and found.detail.startswith(f"kernel command line lacks {IOMMU_PARAM} ")


def test_every_parameter_is_asked_for_by_the_image_checks(tmp_path: Path) -> None:
    """A running x86_64 system with none of them: each kernel check names its parameter."""
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/cmdline").write_text("ro\n")
    (tmp_path / "proc/sys/kernel/arch").write_text("x86_64\n")
    found = run_checks(Root(tmp_path), ["cmdline-*"])
    assert [r.detail.split(" lacks ")[1].split(" (")[0] for r in found] == needed("x86_64")
