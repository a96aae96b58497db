"""A short soak (``bench/soak.py``) in the test run: a few minutes of hotplug, metadata faults,
hostile tpu-env documents, dockerd and vBar kills and tpuboot restarts, with no crash, no device
left unbound, no moment the tpu-env file was missing, garbled or wrong, and vBar up at the end.

``TPUBOOT_SOAK_MINUTES`` (default 3) and ``TPUBOOT_SOAK_SEED`` (default: the clock) set it.
The README's figures come from ``python -m bench.soak --minutes 30``. It lives here, not with the
bench's other tests (tests/unit/bench/), because it boots a guest from this folder's fixtures.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.soak import boot_kwargs, run_soak, soak_install_hook
from harness.vm.artifacts import Artifacts
from harness.vm.machine import VM

from .conftest import ImageFactory

MINUTES = float(os.environ.get("TPUBOOT_SOAK_MINUTES", "3"))


@pytest.mark.vm(timeout=MINUTES * 60 + 900)
def test_a_short_soak_runs_clean(
    vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path
) -> None:
    seed = int(os.environ.get("TPUBOOT_SOAK_SEED") or time.time())
    image = vm_image_factory(soak_install_hook(tpuboot_deb), key="soak")
    with VM.from_artifacts(vm_artifacts, image, name="soak", **boot_kwargs()) as vm:
        vm.wait_booted()
        report = run_soak(vm, MINUTES, seed)
    print(report.render())
    assert not report.failures(), f"seed {seed}:\n" + "\n".join(report.failures())
    assert report.hotplug_cycles > 0 and report.reader["reads"] > 1000
