"""What the runtime-metrics tests share: a stand-in job (this test process, where the stand-in
services listen) and the tpu-env line that names their ports."""

from __future__ import annotations

import os

from tpuboot.config import Config
from tpuboot.holders.procfs import Process
from tpuboot.paths import Root

ME = os.getpid()  # the stand-in services listen in this process: it is the "holder"
JOB = Process(ME, 1, 0, "root", "python3 train.py", "running", None, 0, "job.service", None, None, None, None)


def write_ports(root: Root, config: Config, ports: str) -> None:
    """tpu-env as the job reads it, with ``ports`` as its TPU_RUNTIME_METRICS_PORTS."""
    path = root.path(config.env.tpu_env_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'ACCELERATOR_TYPE="v5litepod-4"\nTOPOLOGY="2x2"\nTPU_RUNTIME_METRICS_PORTS="{ports}"\n')
