"""harness.vm.prefetch: what scripts/test builds beside the unit tests is what the VM tests boot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.vm import artifacts
from harness.vm.prefetch import TESTED, main

VM_TESTS = Path(__file__).resolve().parents[2] / "vm"


def test_every_platform_the_vm_tests_name_is_prefetched() -> None:
    """A platform named in tests/vm and missing here is built inside the QEMU phase after all."""
    named = {name for name, value in vars(artifacts).items() if isinstance(value, artifacts.Platform)}
    used: set[str] = set()
    for module in VM_TESTS.glob("*.py"):
        words = set(re.findall(r"\b[A-Z][A-Z0-9_]+\b", module.read_text()))
        used |= {getattr(artifacts, name).name for name in words & named}
        if "PLATFORMS" in words:
            used |= {platform.name for platform in artifacts.PLATFORMS}
    assert used, "no platform found in tests/vm: the test reads them wrong"
    assert used <= {platform.name for platform in TESTED}
    assert len({platform.name for platform in TESTED}) == len(TESTED)


def test_an_unknown_platform_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["debian99"])
    assert exit_.value.code == 2
    assert "no platform 'debian99'; known: debian12, debian13" in capsys.readouterr().err
