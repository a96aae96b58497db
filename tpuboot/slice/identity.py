"""Who this worker is in its slice, and whether every source agrees: pure judgement of the facts.

The failures users meet first (doc/slice.md): a host whose metadata came up blank starts as a
second worker 0 (marin #8743), a worker list of the wrong length ("Expected 4 worker addresses,
got 1", Lightning #20244), a host whose own address is not at its own index, incomplete or stale
``MEGASCALE_*`` values. Each is one :class:`~tpuboot.verdicts.CheckResult` with its fix;
the slice's size comes from :func:`tpuboot.slice.shape.read_slice` (tpu-env and machine type).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tpuboot.env.tpuenv import env_value
from tpuboot.errors import printable, shown
from tpuboot.numbers import ascii_int
from tpuboot.slice.facts import Facts
from tpuboot.slice.resolve import resolve
from tpuboot.slice.shape import read_slice
from tpuboot.slice.workers import (
    ENDPOINTS_FIX,
    Worker,
    WorkerListError,
    duplicates,
    parse_endpoints,
    parse_hostnames,
)
from tpuboot.verdicts import CheckResult, Status, failed, passed, skipped, warned

RECREATE = "recreate this VM's slice: the TPU API sets agent-worker-number and worker-network-endpoints"
ENV_FIX = "tpuboot env rewrites tpu-env from the metadata server; if it is wrong there, recreate the slice"
MEGASCALE = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")


@dataclass(frozen=True)
class Identity:
    """This worker's index, the slice's workers and the findings (named checks) about them."""

    worker: int | None
    workers: list[Worker]
    env: Mapping[str, str]
    findings: list[CheckResult] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return not any(f.status == "FAIL" for f in self.findings)


def _named(name: str, result: CheckResult) -> CheckResult:
    return replace(result, name=name)


def _worker_id(facts: Facts, env: Mapping[str, str], hosts: int | None) -> tuple[int | None, CheckResult]:
    from_metadata = (facts.worker_number or "").strip() or None
    from_env = env_value(env, "WORKER_ID")
    many = hosts is not None and hosts > 1
    if from_metadata is None and from_env is None:
        if many:
            return None, failed(
                f"agent-worker-number is blank and tpu-env has no WORKER_ID: this worker of {hosts} would "
                "start as worker 0 beside the real one",
                RECREATE,
            )
        return 0, skipped("single host: no worker number set, worker 0")
    text = from_metadata if from_metadata is not None else from_env
    where = "agent-worker-number" if from_metadata is not None else "tpu-env's WORKER_ID"
    worker = ascii_int(text)
    if worker is None or worker > 999_999:
        return None, failed(f"{where} {shown(text)} is not a worker number (0, 1, ...)", RECREATE)
    if hosts is not None and worker >= hosts:
        return None, failed(
            f"{where} {worker} is outside the slice: its {hosts} hosts are workers 0 to {hosts - 1}", RECREATE
        )
    if from_metadata is None and many:
        return worker, failed(
            f"agent-worker-number is blank (tpu-env says worker {worker}): a worker with no number starts as "
            "worker 0 beside the real one",
            RECREATE,
        )
    if from_metadata is not None and from_env is not None and from_env != from_metadata:
        return worker, failed(
            f"agent-worker-number {from_metadata} but tpu-env's WORKER_ID {shown(from_env)}", ENV_FIX
        )
    return worker, passed(f"this host is worker {worker}" + (f" of {hosts}" if hosts else ""))


def _workers(facts: Facts, env: Mapping[str, str], hosts: int | None) -> tuple[list[Worker], CheckResult]:
    hostnames = env_value(env, "WORKER_HOSTNAMES")
    try:
        if facts.endpoints is not None and facts.endpoints.strip():
            workers, source = parse_endpoints(facts.endpoints), "worker-network-endpoints"
        elif hostnames is not None:
            workers, source = parse_hostnames(hostnames), "TPU_WORKER_HOSTNAMES"
        elif hosts is not None and hosts > 1:
            return [], failed(
                f"no worker-network-endpoints and no TPU_WORKER_HOSTNAMES on a slice of {hosts} hosts",
                RECREATE,
            )
        else:
            return [], skipped("no worker list: a single host")
    except WorkerListError as exc:
        return [], failed(exc.detail, ENDPOINTS_FIX)
    twice = duplicates(workers)
    if twice:
        address, indexes = next(iter(twice.items()))
        return workers, failed(
            f"{source} gives {address} to workers {', '.join(map(str, indexes))}", RECREATE
        )
    if hosts is None:
        return workers, warned(
            f"{source}: {len(workers)} workers; the slice's size is unknown (see doctor's slice check)"
        )
    if len(workers) != hosts:
        return workers, failed(f"{source} has {len(workers)} workers; the slice has {hosts} hosts", RECREATE)
    return workers, passed(f"{source}: {len(workers)} workers, no duplicate")


def _own_address(facts: Facts, worker: int | None, workers: list[Worker]) -> CheckResult:
    own = (facts.own_address or "").strip()
    if not workers or worker is None or worker >= len(workers):
        return skipped("no worker list or no worker number to place this host in")
    if not own:
        return warned(
            "the metadata server gives no network-interfaces/0/ip: this host's place is not checked"
        )
    listed = workers[worker].address
    if listed == own:
        return passed(f"{own} stands at index {worker}")
    elsewhere = [w.index for w in workers if w.address == own]
    where = f"; it stands at index {elsewhere[0]}" if elsewhere else "; it is not in the list"
    return failed(f"this host is {printable(own)}, but worker {worker}'s entry is {listed}{where}", RECREATE)


def _multislice(env: Mapping[str, str]) -> CheckResult:
    values = {key: (env.get(key) or "").strip() for key in (*MEGASCALE, "MEGASCALE_PORT")}
    if not any(values.values()):
        return skipped("not a multislice: no MEGASCALE_* in tpu-env")
    missing = [key for key in MEGASCALE if not values[key]]
    if missing:
        return failed(f"tpu-env sets some MEGASCALE_* values but not {', '.join(missing)}", ENV_FIX)
    slices, slice_id = ascii_int(values["MEGASCALE_NUM_SLICES"]), ascii_int(values["MEGASCALE_SLICE_ID"])
    if not slices:
        return failed(
            f"MEGASCALE_NUM_SLICES {shown(values['MEGASCALE_NUM_SLICES'])} is not a number from 1", ENV_FIX
        )
    if slice_id is None or slice_id >= slices:
        return failed(
            f"MEGASCALE_SLICE_ID {shown(values['MEGASCALE_SLICE_ID'])} is not a slice of 0 to {slices - 1}",
            ENV_FIX,
        )
    port = values["MEGASCALE_PORT"]
    if port and (ascii_int(port) or 0) not in range(1, 65536):
        return failed(f"MEGASCALE_PORT {shown(port)} is not a TCP port", ENV_FIX)
    coordinator = values["MEGASCALE_COORDINATOR_ADDRESS"]
    host = coordinator.rsplit(":", 1)[0] if coordinator.count(":") == 1 else coordinator
    if resolve(host, family=socket.AF_UNSPEC) is None:
        return failed(f"MEGASCALE_COORDINATOR_ADDRESS {shown(coordinator)} does not resolve", ENV_FIX)
    return passed(f"slice {slice_id} of {slices}, coordinator {printable(coordinator)}")


def judge(facts: Facts) -> Identity:
    """This worker's identity and every finding about it."""
    env = facts.env or {}
    findings = []
    if facts.env is None:
        findings.append(CheckResult("tpu-env", "FAIL", facts.env_problem or "tpu-env is unreadable", ENV_FIX))
    hosts = read_slice(env, facts.machine_type).slice
    size = hosts.hosts if hosts is not None else None
    worker, found = _worker_id(facts, env, size)
    findings.append(_named("worker-id", found))
    workers, listed = _workers(facts, env, size)
    findings.append(_named("worker-list", listed))
    findings.append(_named("own-address", _own_address(facts, worker, workers)))
    findings.append(_named("multislice", _multislice(env)))
    return Identity(worker, workers, env, findings)


def one_check(identity: Identity) -> CheckResult:
    """The identity's findings as one verdict (doctor's ``slice-identity``): the FAILs, else the
    WARNs, else what passed; SKIP on a single host (no worker list: only its number to say).
    Unnamed, as a check is."""
    judged = [f for f in identity.findings if f.status != "SKIP"]
    if not identity.workers and all(f.name == "worker-id" and f.status == "PASS" for f in judged):
        return skipped("a single host: no worker list to judge" + "".join(f" ({f.detail})" for f in judged))
    worst: tuple[Status, ...] = ("FAIL", "WARN", "PASS")
    for status in worst:
        found = [f for f in identity.findings if f.status == status]
        if found:
            detail = "; ".join(f"{f.name}: {f.detail}" for f in found)
            fix = next((f.fix for f in found if f.fix), "") if status != "PASS" else ""
            return CheckResult("", status, detail, fix)
    return skipped("; ".join(f.detail for f in identity.findings) or "nothing to judge")
