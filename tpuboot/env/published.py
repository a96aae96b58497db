"""What no single worker can see, made comparable across the slice: this worker's identity and a
digest of tpu-env's slice-wide keys, published where operators already look.

Two workers that both think they are worker 0, or a tpu-env that differs on one worker (a stale
``MEGASCALE_COORDINATOR_ADDRESS`` after a preemption, ray PR #62893), are facts of the slice. Each
worker publishes ``worker=N digest=HEX`` in its ``tpuboot/tpu-env`` guest attribute and as
``tpuboot_slice_identity_info{worker,digest}``; the comparison is the operator's (doc/slice.md:
a PromQL rule, or the workers' guest attributes side by side). Workers do not ask each other.

The digest is SHA-256 over the sorted ``KEY=value`` lines of tpu-env without :data:`PER_WORKER`,
its first 16 hex digits: the same on every worker of a slice, whatever order the keys came in. A
value's backslashes and newlines are escaped with a backslash, so a value cannot pass for a
line of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from tpuboot.env.tpuenv import env_value
from tpuboot.numbers import ascii_int

#: tpu-env's keys that differ from worker to worker by design: this worker's index (``WORKER_ID``;
#: ``TPU_WORKER_ID`` on VMs made through Compute Engine and on GKE). Every other key is the
#: slice's: ``NODE_ID`` names the TPU node (the same on each worker), ``TPU_WORKER_HOSTNAMES`` and
#: ``HOST_BOUNDS`` describe the whole slice, and ``MEGASCALE_SLICE_ID`` is the same on every
#: worker of one slice (it differs between the slices of a multislice, which are compared apart).
PER_WORKER = frozenset({"WORKER_ID", "TPU_WORKER_ID"})
#: Hex digits of the digest published: 64 bits tell a slice's few tpu-envs apart.
DIGEST_HEX = 16


@dataclass(frozen=True)
class Published:
    """This worker's index as tpu-env gives it (None: tpu-env has none) and the slice-wide digest."""

    worker: int | None
    digest: str

    def attribute(self) -> str:
        """The words appended to the ``tpuboot/tpu-env`` guest attribute."""
        worker = f"worker={self.worker} " if self.worker is not None else ""
        return f"{worker}digest={self.digest}"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def slice_digest(env: Mapping[str, str]) -> str:
    """The first :data:`DIGEST_HEX` hex digits of SHA-256 over the sorted ``KEY=value`` lines of
    ``env`` without its per-worker keys."""
    lines = sorted(f"{key}={_escaped(value)}" for key, value in env.items() if key not in PER_WORKER)
    text = "".join(line + "\n" for line in lines)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:DIGEST_HEX]


def published(env: Mapping[str, str]) -> Published:
    """What this worker publishes of tpu-env's ``env``."""
    text = env_value(env, "WORKER_ID")
    return Published(ascii_int(text) if text is not None else None, slice_digest(env))
