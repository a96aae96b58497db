"""A chip freed for a reset: what stops it, and which holders ``--kill`` ends first.

`tpuboot reset` and its ``--dry-run`` judge alike, from one /proc scan of the chip: a scan that
could not see every process may have missed a holder (refused: ``--kill`` ends known holders
only); a holder without ``--kill`` refuses; with it, a holder tpuboot never ends (its agents, PID 1,
tpuboot itself: :func:`tpuboot.holders.release.protected`) refuses and every other is ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpuboot.config import Config
from tpuboot.devices.chips import Chip
from tpuboot.devices.reset import ResetRefused
from tpuboot.holders.procfs import Process
from tpuboot.holders.release import end, protected
from tpuboot.holders.report import describe, gather
from tpuboot.holders.supervised import supervised
from tpuboot.paths import Root


@dataclass(frozen=True)
class Freeing:
    """Why the chip cannot be freed now (each one line; none: it can), and whom ``--kill`` ends."""

    refusals: tuple[str, ...]
    to_end: tuple[Process, ...]


def judge(root: Root, config: Config, chip: Chip, *, kill: bool) -> Freeing:
    """What freeing ``chip`` needs now."""
    report = gather(root, [chip])
    if report.maybe_held:
        blockers = "; ".join(report.blockers(chip))
        return Freeing((f"chip {chip.address} may be held: {blockers}; run as root, or wait",), ())
    (held,) = report.chips
    if held.holders and not kill:
        who = "; ".join(describe(h.process) for h in held.holders)
        return Freeing(
            (f"chip {chip.address} is held by {who}; end it first, or pass --kill to end it first",), ()
        )
    if not held.holders:
        return Freeing((), ())
    agents = supervised(root, config)
    why = {h.process.pid: protected(h.process, agents) for h in held.holders}
    spared = [f"{describe(h.process)} ({why[h.process.pid]})" for h in held.holders if why[h.process.pid]]
    refusals = (
        [f"chip {chip.address} is held by {'; '.join(spared)}, which tpuboot never ends"] if spared else []
    )
    return Freeing(tuple(refusals), tuple(h.process for h in held.holders if not why[h.process.pid]))


def free(root: Root, config: Config, chip: Chip, *, kill: bool) -> list[str]:
    """Nobody holds ``chip`` once this returns: its holders ended (``kill``; one line each said of
    them), or ResetRefused with the first reason."""
    freeing = judge(root, config, chip, kill=kill)
    if freeing.refusals:
        raise ResetRefused(freeing.refusals[0])
    said = [end(root, p) for p in freeing.to_end]
    blockers = gather(root, [chip]).blockers(chip) if said else []
    if blockers:
        raise ResetRefused(f"chip {chip.address} is still held: {blockers[0]}")
    return said
