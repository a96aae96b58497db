"""What the holder tests share: a container ID and the chips report over the fake kernel."""

from __future__ import annotations

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.config import Config

DOCKER_ID = "ab" * 32


def chips(kernel: FakeKernel) -> list:
    from tpuboot.holders.report import chips_of

    return chips_of(kernel.root, Config())
