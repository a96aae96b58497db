"""Which TCP ports each worker of a slice must be reachable on before a job starts: data.

Sources (doc/slice.md has them): SliceBuilder listens on 8471 on every worker; jax's coordinator
on worker 0 listened on 8476 up to jax 0.8.0 and on 8482 from 0.8.1 (jax #35905, while the
default firewall rule opens tcp 8470, 8471, 8474, 8476 and 11211); a multislice job's megascale
transport on ``MEGASCALE_PORT`` where the launcher sets it (8080 by default in Ray's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tpuboot.numbers import ascii_int


@dataclass(frozen=True)
class Port:
    """A port a role serves, and what it is for (said in every finding about it)."""

    number: int
    purpose: str
    coordinator_only: bool = False


SLICE_BUILDER = Port(8471, "SliceBuilder")
COORDINATOR_PORTS = (
    Port(8476, "jax coordinator up to jax 0.8.0", coordinator_only=True),
    Port(8482, "jax coordinator from jax 0.8.1", coordinator_only=True),
)
MEGASCALE_KEY = "MEGASCALE_PORT"
#: The worker that hosts the job's coordinator (jax's process 0).
COORDINATOR = 0


def megascale_port(env: Mapping[str, str]) -> Port | None:
    """``MEGASCALE_PORT`` from tpu-env as a port, None when unset; a bad value is the identity's finding."""
    number = ascii_int((env.get(MEGASCALE_KEY) or "").strip())
    return Port(number, "megascale") if number is not None and 0 < number < 65536 else None


def ports_of(worker: int, env: Mapping[str, str]) -> list[Port]:
    """The ports worker ``worker`` must be reachable on."""
    ports = [SLICE_BUILDER]
    if worker == COORDINATOR:
        ports.extend(COORDINATOR_PORTS)
    megascale = megascale_port(env)
    if megascale is not None and megascale.number not in {p.number for p in ports}:
        ports.append(megascale)
    return ports
