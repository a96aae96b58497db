"""`tpuboot top`: each chip holder's devices as libtpu reports them, in the terminal, as tpu-info
shows them: one poll with the daemon's own code (:mod:`tpuboot.runtime.collector`), whether or
not the daemon runs. Exit 0 when read, 1 when libtpu reports a fault or a holder's port does not
answer, so a script can ask "is the job healthy?"."""

from __future__ import annotations

from collections.abc import Callable

from tpuboot.config import Config
from tpuboot.errors import TpubootError, printable
from tpuboot.paths import Root
from tpuboot.runtime.collector import Holders, RuntimeCollector, Snapshot, scan_holders, targets
from tpuboot.runtime.reading import Device

GIB = float(1 << 30)


class RuntimeOff(TpubootError):
    """Nothing can be read (no gRPC)."""


def look(
    root: Root, config: Config, *, holders: Callable[[], Holders] | None = None, proc: Root | None = None
) -> Snapshot:
    """One poll of every port a chip's holder listens on (empty when no chip is held). Seams
    (tests): ``holders`` (the scan) and ``proc``, as :class:`RuntimeCollector` takes them."""
    collector = RuntimeCollector(root, config, proc=proc)
    if collector.missing:
        raise RuntimeOff(collector.missing)
    held = holders() if holders is not None else scan_holders(root, config)
    if not held.processes:
        return Snapshot()
    target = targets(root, config, held)
    return collector.poll_once(held.processes, target.ports, target.model, target.topology)


def healthy(snapshot: Snapshot) -> bool:
    return not snapshot.hang and not snapshot.slice_errors and all(p.reading for p in snapshot.ports)


def _hbm(d: Device) -> str:
    if d.memory_used is None or d.memory_total is None:
        return "-"
    share = f" ({100 * d.memory_used / d.memory_total:.0f}%)" if d.memory_total else ""
    return f"{d.memory_used / GIB:.2f} GiB / {d.memory_total / GIB:.2f} GiB{share}"


def render(snapshot: Snapshot) -> list[str]:
    if not snapshot.ports:
        return ["no process holding a TPU chip serves libtpu's metrics: nothing to show (tpuboot who)"]
    lines = []
    shape = " ".join(x for x in (snapshot.model, snapshot.topology) if x)
    if shape:
        lines.append(shape)
    for p in snapshot.ports:
        h = p.holder
        lines.append(f"port {p.port}  PID {h.pid} ({printable(h.where)})  {printable(h.command)[:60]}")
        if p.reading is None:
            lines.append(f"  not answering: {p.error}")
            continue
        r = p.reading
        lines.append(f"  {'device':<8}{'duty cycle':>12}  HBM used / total")
        for d in r.devices:
            duty = "-" if d.duty_cycle is None else f"{d.duty_cycle:.1f}%"
            lines.append(f"  {d.device:<8}{duty:>12}  {_hbm(d)}")
        hang = "HANG DETECTED" if r.hang else "no hang"
        error = "no slice error" if r.slice_error is None else f"SLICE ERROR: {printable(r.slice_error)}"
        lines.append(f"  {hang}, {error}")
        lines += [f"  left out: {problem}" for problem in r.problems]
    return lines


def as_dict(snapshot: Snapshot) -> dict[str, object]:
    return {
        "model": snapshot.model,
        "topology": snapshot.topology,
        "hang": snapshot.hang,
        "ports": [
            {
                "port": p.port,
                "pid": p.holder.pid,
                "holder": p.holder.where,
                "error": p.error,
                "hang": bool(p.reading and p.reading.hang),
                "slice_error": p.reading.slice_error if p.reading else None,
                "devices": [
                    {
                        "device": d.device,
                        "duty_cycle": d.duty_cycle,
                        "memory_used": d.memory_used,
                        "memory_total": d.memory_total,
                    }
                    for d in (p.reading.devices if p.reading else ())
                ],
            }
            for p in snapshot.ports
        ],
    }
