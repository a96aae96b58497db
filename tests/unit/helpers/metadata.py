"""A metadata client and a Config for the emulator on 127.0.0.1, with quick backoff: what the
metadata, environment, container and daemon tests share (the conftest's fixtures use them too).
"""

from __future__ import annotations

import random

from harness.mds_emulator import MetadataEmulator
from tpuboot.backoff import Backoff
from tpuboot.config import Config, EnvConfig, MetadataConfig
from tpuboot.gce.client import MetadataClient

FAST_BACKOFF = Backoff(initial=0.01, maximum=0.05, floor=0.01)


def make_client(emu: MetadataEmulator, *, timeout: float = 2.0, max_body: int = 1 << 20) -> MetadataClient:
    """A client for ``emu`` with quick backoff (tests wait on deadlines, not on real boot pacing)."""
    return MetadataClient(
        emu.url,
        timeout=timeout,
        max_body=max_body,
        backoff=FAST_BACKOFF,
        rng=random.Random(7),
        min_poll_interval=0.05,
    )


#: The SMBIOS system UUID of the ``root`` tree's instance.
INSTANCE_UUID = "5d1c3a7e-0b6f-4e2a-9c41-7f3e2d1b0a98"


def make_config(emu: MetadataEmulator | None = None, **env: object) -> Config:
    """A Config pointing at ``emu``, with EnvConfig fields overridden by ``env``."""
    metadata = MetadataConfig(host=emu.host if emu else None, timeout=2.0)
    return Config(metadata=metadata, env=EnvConfig(**env))  # type: ignore[arg-type]
