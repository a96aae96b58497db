"""What the holder tests share: a container ID and the chips report over the fake kernel."""

from __future__ import annotations

import os
from typing import Any

from tests.unit.fakes.kernel import FakeKernel
from tpuboot.config import Config

DOCKER_ID = "ab" * 32


def chips(kernel: FakeKernel) -> list:
    from tpuboot.holders.report import chips_of

    return chips_of(kernel.root, Config())


def refuse_fds(monkeypatch: Any, pid: int) -> None:
    """The scan may not read ``pid``'s fds (EACCES), as for another user's process without root."""
    from tpuboot.holders import scan as scan_module

    real = os.open

    def refused(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(f"/{pid}/fd"):
            raise PermissionError(13, "Permission denied")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(scan_module.os, "open", refused)
