"""The slice's worker list, as the metadata server (``worker-network-endpoints``) or tpu-env
(``TPU_WORKER_HOSTNAMES``, on GKE) gives it.

``worker-network-endpoints`` is ``NAME:ID:IP`` entries separated by commas; jax takes the third
field as the worker's address, in list order. Anything else (an empty field, an entry with no
address, an IPv6 address that would be cut at its colons, more entries than any pod has workers)
is refused whole with one line naming the entry: a job given such a list fails at its barrier.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from tpuboot.devices.table import GENERATIONS
from tpuboot.errors import TpubootError, shown

#: More workers than the largest pod has hosts cannot be a slice (TPU7x: 9216 chips, 4 a host).
MAX_WORKERS = max(g.max_chips // g.host_chips for g in GENERATIONS)
#: A host name as DNS allows it (labels of letters, digits and '-', dot-separated).
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)
ENDPOINTS_FIX = "recreate the TPU VM's slice (the TPU API sets worker-network-endpoints on every worker)"


class WorkerListError(TpubootError):
    """The worker list cannot be read as one: ``detail`` names the entry; the message adds the fix."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{detail}")
        self.detail = detail


@dataclass(frozen=True)
class Worker:
    """One worker of the slice: its index (its place in the list) and the address peers dial."""

    index: int
    address: str
    name: str = ""


def _entries(text: str, what: str) -> list[str]:
    entries = text.strip().split(",")
    if len(entries) > MAX_WORKERS:
        raise WorkerListError(
            f"{what} has {len(entries)} entries, more than the {MAX_WORKERS} workers of the largest pod"
        )
    return [e.strip() for e in entries]


def _address(text: str, what: str, n: int) -> str:
    """An IPv4 address or a host name; IPv6 and anything else refused with the entry named."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        if _HOSTNAME.match(text) and not text.replace(".", "").isdigit():
            return text
        raise WorkerListError(f"{what} entry {n} has no usable address ({shown(text)})") from None
    if ip.version != 4:
        raise WorkerListError(f"{what} entry {n} is IPv6 ({text}): jax reads NAME:ID:IPV4")
    return text


def parse_endpoints(text: str) -> list[Worker]:
    """``worker-network-endpoints`` as workers, in order; WorkerListError if any entry is malformed."""
    what = "worker-network-endpoints"
    workers = []
    for n, entry in enumerate(_entries(text, what)):
        fields = entry.split(":")
        if len(fields) != 3 or not all(fields):
            raise WorkerListError(f"{what} entry {n} ({shown(entry)}) is not NAME:ID:IP")
        workers.append(Worker(n, _address(fields[2], what, n), fields[0]))
    return workers


def parse_hostnames(text: str) -> list[Worker]:
    """``TPU_WORKER_HOSTNAMES`` (addresses or names separated by commas) as workers, in order."""
    what = "TPU_WORKER_HOSTNAMES"
    return [Worker(n, _address(entry, what, n)) for n, entry in enumerate(_entries(text, what))]


def duplicates(workers: list[Worker]) -> dict[str, list[int]]:
    """Each address that more than one worker has, with their indexes."""
    seen: dict[str, list[int]] = {}
    for w in workers:
        seen.setdefault(w.address.lower(), []).append(w.index)
    return {address: indexes for address, indexes in seen.items() if len(indexes) > 1}
