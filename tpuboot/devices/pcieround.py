"""The TPUs' PCIe state, read once a tick for both of its readers: a part of the daemon.

At each tick (in the daemon's pool, tpuboot/component.py) the TPU functions present are surveyed and
each one's link and AER counters read once (tpuboot/devices/health.py). The guest attribute's
summary is made of that reading first (a word; a change is reported, and the loop shows it), then
recovery.automatic looks for wedged chips in the same reading (tpuboot/devices/recovery.py), so the
summary is of the state before any reset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpuboot.component import Part, Report
from tpuboot.devices.health import read_healths, summary
from tpuboot.devices.survey import survey
from tpuboot.eventloop import nothing

if TYPE_CHECKING:
    from tpuboot.devices.recovery import AutoRecovery
    from tpuboot.devices.vfio import Binder


class PcieRound(Part):
    """``summarise``: the guest attribute's reader is on; ``recovery``: recovery.automatic's."""

    name = "PCIe round"
    periodic = True

    def __init__(self, binder: Binder, recovery: AutoRecovery | None = None, summarise: bool = True) -> None:
        self.binder = binder
        self.recovery = recovery
        self.summarise = summarise
        self._summary: str | None = None  # written by the pool only, replaced whole
        self._report: Report = nothing

    @property
    def summary(self) -> str | None:
        """The last reading for the guest attribute (``ok``, or how many functions have each kind of
        finding), from any thread; None: not read yet."""
        return self._summary

    def start(self, report: Report) -> None:
        self._report = report

    def tick(self) -> None:
        tpus = survey(self.binder)
        health = read_healths(self.binder.root, (t.address for t in tpus))
        if self.summarise:
            value = summary(health.values())
            if value != self._summary:  # an unchanged reading wakes nothing
                self._summary = value
                self._report()
        if self.recovery is not None:
            self.recovery.check(tpus, health)
