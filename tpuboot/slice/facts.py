"""What this worker is told about its slice: four metadata values and the tpu-env file.

Read once per look, each within the look's deadline. An absent key is None (a finding, judged by
:mod:`tpuboot.slice.identity`); a server that does not answer is a MetadataError, said in one line
by the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tpuboot.atomicfile import read_file
from tpuboot.env.tpuenv import MAX_TPU_ENV_BYTES, parse_env_file
from tpuboot.gce.keys import MACHINE_TYPE, OWN_ADDRESS, WORKER_ENDPOINTS, WORKER_NUMBER
from tpuboot.gce.replies import MetadataAbsent, Reply
from tpuboot.paths import Root


class MetadataReader(Protocol):
    def get(self, path: str, *, deadline_s: float) -> Reply: ...


@dataclass(frozen=True)
class Facts:
    """The raw values; None where the key or file is absent."""

    env: dict[str, str] | None  # tpu-env's values; None: missing or not KEY="value" lines
    env_problem: str | None  # why ``env`` is None
    worker_number: str | None  # agent-worker-number
    endpoints: str | None  # worker-network-endpoints
    own_address: str | None  # network-interfaces/0/ip
    machine_type: str | None


def _value(client: MetadataReader, path: str, deadline_s: float) -> str | None:
    try:
        return client.get(path, deadline_s=deadline_s).text
    except MetadataAbsent:
        return None


def _tpu_env(root: Root, path: str) -> tuple[dict[str, str] | None, str | None]:
    data = read_file(root, path, limit=MAX_TPU_ENV_BYTES)
    if data is None:
        return None, f"{path} is missing"
    values = parse_env_file(data.decode("utf-8", "replace"))
    if values is None:
        return None, f'{path} is not a file of KEY="value" lines'
    return values, None


def read_facts(client: MetadataReader, root: Root, tpu_env_path: str, *, deadline_s: float) -> Facts:
    """The slice's facts as this worker sees them now; MetadataError if the server does not answer."""
    env, problem = _tpu_env(root, tpu_env_path)
    return Facts(
        env=env,
        env_problem=problem,
        worker_number=_value(client, WORKER_NUMBER, deadline_s),
        endpoints=_value(client, WORKER_ENDPOINTS, deadline_s),
        own_address=_value(client, OWN_ADDRESS, deadline_s),
        machine_type=_value(client, MACHINE_TYPE, deadline_s),
    )
