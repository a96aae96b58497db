"""One look at the slice: the identity's findings, every peer's paths swept at once, and this host's
own slice ports; each a named :class:`~tpuboot.verdicts.CheckResult` with its fix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpuboot.holders.procfs import ProcReader
from tpuboot.holders.report import describe
from tpuboot.holders.sockets import port_holders
from tpuboot.paths import Root
from tpuboot.slice.facts import Facts
from tpuboot.slice.identity import Identity, judge
from tpuboot.slice.ports import ports_of
from tpuboot.slice.resolve import resolve
from tpuboot.slice.sweep import DROPPED, PASSABLE, UNREACHABLE, Outcome, Target, sweep
from tpuboot.verdicts import CheckResult, failed, passed, skipped


@dataclass(frozen=True)
class SliceReport:
    identity: Identity
    paths: list[Outcome]
    findings: list[CheckResult]

    @property
    def holds(self) -> bool:
        return not any(f.status == "FAIL" for f in self.findings)

    def as_dict(self) -> dict[str, object]:
        return {
            "worker": self.identity.worker,
            "workers": len(self.identity.workers),
            "holds": self.holds,
            "findings": [f.as_dict() for f in self.findings],
            "paths": [
                {
                    "worker": o.target.worker,
                    "address": o.target.address,
                    "port": o.target.port,
                    "purpose": o.target.purpose,
                    "state": o.state,
                    "detail": o.detail,
                }
                for o in self.paths
            ],
        }


def targets(identity: Identity) -> tuple[list[Target], list[CheckResult]]:
    """Every peer's (address, port) to sweep, and a finding for each peer whose name does not resolve."""
    found: list[Target] = []
    unresolved: list[CheckResult] = []
    for w in identity.workers:
        if w.index == identity.worker:
            continue
        address = resolve(w.address)
        if address is None:
            unresolved.append(
                failed(f"worker {w.index}'s name {w.address} does not resolve", "check the slice's DNS")
            )
            continue
        found.extend(Target(w.index, address, p.number, p.purpose) for p in ports_of(w.index, identity.env))
    return found, [replace(r, name="peer-path") for r in unresolved]


def _path_finding(o: Outcome) -> CheckResult:
    t = o.target
    where = f"worker {t.worker} ({t.address}) port {t.port} ({t.purpose})"
    if o.state == DROPPED:
        fix = f"allow tcp:{t.port} between the slice's workers in the VPC firewall rule of the TPU's network"
        return failed(f"{where}: dropped (the connect timed out{': ' + o.detail if o.detail else ''})", fix)
    if o.state == UNREACHABLE:
        return failed(f"{where}: unreachable ({o.detail})", f"check that worker {t.worker} is up and routed")
    return failed(f"{where}: {o.detail or o.state}", f"check worker {t.worker}'s network")


def path_findings(paths: list[Outcome], workers: int) -> list[CheckResult]:
    """A PASS that counts the paths by state, or one FAIL per path that is not open."""
    bad = [replace(_path_finding(o), name="peer-path") for o in paths if o.state not in PASSABLE]
    if bad:
        return bad
    if not paths:
        return [CheckResult("peer-paths", "SKIP", "no peer to reach")]
    counts = {s: sum(o.state == s for o in paths) for s in PASSABLE}
    shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return [replace(passed(f"{len(paths)} paths to {workers - 1} peers open ({shown})"), name="peer-paths")]


def own_ports(root: Root, identity: Identity) -> CheckResult:
    """This host's slice ports are free for the job: a listener on one is a stale process."""
    if identity.worker is None:
        return replace(skipped("no worker number: which ports this host serves is unknown"), name="own-ports")
    ports = ports_of(identity.worker, identity.env)
    held = port_holders(root, (p.number for p in ports))
    if not held:
        return replace(passed(f"tcp {', '.join(str(p.number) for p in ports)} free"), name="own-ports")
    reader = ProcReader(root)
    parts = []
    for p in ports:
        if p.number in held:
            named = [proc for pid in held[p.number] if (proc := reader.process(pid)) is not None]
            who = "; ".join(describe(proc) for proc in named) or "a process tpuboot cannot name"
            parts.append(f"tcp {p.number} ({p.purpose}) is held by {who}")
    return replace(
        failed("; ".join(parts), "end that process before the job starts: the job cannot listen on its port"),
        name="own-ports",
    )


def look(facts: Facts, root: Root, *, connect_timeout: float, deadline_s: float) -> SliceReport:
    """The whole verdict: identity, then (if the list is known) every path, then own ports."""
    identity = judge(facts)
    found, unresolved = targets(identity)
    paths = sweep(found, connect_timeout=connect_timeout, deadline_s=deadline_s)
    findings = [*identity.findings, *unresolved]
    if identity.workers:
        findings += path_findings(paths, len(identity.workers))
    findings.append(own_ports(root, identity))
    return SliceReport(identity, paths, findings)
