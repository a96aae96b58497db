"""``recovery.automatic``: the daemon brings back a chip that fell off the bus or logged a fatal
PCIe error, up the same ladder as `tpuboot reset` (tpuboot/devices/reset.py). Off by default.

A part of the daemon (tpuboot/component.py): at each tick (in its worker pool, never the loop)
every VFIO chip of the tick's device snapshot is looked at, in the reading the guest attribute's
PCIe summary is made of: a function that no longer answers config reads (vendor id 0xffff), or a
fatal AER error since the chip's last good reset (:meth:`Health.since_reset`: the errors a reset
cleared up are history), makes it wedged. A wedged chip somebody holds is never reset (the job
would lose the device under it): that is said once, and the next tick looks again. Otherwise the
ladder climbs, behind the same circuit breaker as the command (``recovery.max_resets_per_hour``);
an open breaker is said once. A chip the kernel removed is not looked for: a hot remove is
somebody's decision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal

from tpuboot import metrics
from tpuboot.component import Part
from tpuboot.devices.chips import Chip
from tpuboot.devices.health import Health, judge
from tpuboot.devices.reset import Breaker, Ladder, ResetRefused
from tpuboot.devices.snapshot import DeviceSnapshot
from tpuboot.devices.table import VFIO_ACCESS
from tpuboot.devices.vfio import Binder

log = logging.getLogger("tpuboot.recovery")

#: What became of an automatic reset (the metric's ``result``).
Outcome = Literal["recovered", "failed"]
#: Who may hold a chip now, in one line each (tpuboot/holders/report.py's blockers: its holders,
#: holders of a chip unknown, processes the scan could not see); [] only when it is surely free.
HolderLookup = Callable[[Chip], list[str]]
#: The kinds of doctor's PCIe findings (devices/health.py's judge) that a reset is for.
WEDGED = ("lost", "fatal")


def wedged(chip: Chip, health: Mapping[str, Health]) -> str | None:
    """Why ``chip`` needs a reset (doctor's words for it), or None when it does not; ``health``
    holds a reading of each of its functions."""
    for fn in chip.functions:
        for finding in judge(health[fn.address]):
            if finding.kind in WEDGED:
                return finding.detail
    return None


class AutoRecovery(Part):
    """The daemon's side of ``recovery.automatic``; :meth:`check` is its tick's work."""

    name = "recovery.automatic"
    periodic = True

    def __init__(self, binder: Binder, max_resets_per_hour: int, holders: HolderLookup) -> None:
        """``holders``: who may hold a chip (the daemon's is :func:`tpuboot.holders.report.blockers_of`;
        the devices package does not scan /proc itself)."""
        self.binder = binder
        self.ladder = Ladder(binder, Breaker(binder.root, max_resets_per_hour))
        self.holders = holders
        self._said: dict[str, str] = {}  # chip → the last thing said about leaving it be

    @staticmethod
    def chips(devices: DeviceSnapshot) -> list[Chip]:
        return [chip for chip in devices.chips if chip.access == VFIO_ACCESS]

    def tick(self, devices: DeviceSnapshot) -> None:
        self.check(devices)

    def check(self, devices: DeviceSnapshot | None = None) -> None:
        """Every wedged chip nobody holds, reset (from the pool: a climb takes seconds). ``devices``:
        the tick's snapshot, shared with the guest attribute's summary (default: taken now)."""
        devices = DeviceSnapshot(self.binder) if devices is None else devices
        for chip in self.chips(devices):
            why = wedged(chip, devices.health)
            if why is None:
                self._said.pop(chip.address, None)
                continue
            self._recover(chip, why)

    def _recover(self, chip: Chip, why: str) -> None:
        fields = {"DBDF": chip.address, "TPU_RECOVERY": "automatic"}
        held = self.holders(chip)
        if held:
            self._once(
                chip, f"chip {chip.address}: {why}; not reset while it may be held: {'; '.join(held)}", fields
            )
            return
        log.warning("chip %s: %s; resetting it (recovery.automatic)", chip.address, why, extra=fields)
        try:
            steps = self.ladder.climb(chip)
        except ResetRefused as exc:
            self._once(chip, f"chip {chip.address}: {why}; not reset: {exc}", fields)
            return
        self._said.pop(chip.address, None)
        outcome: Outcome = "recovered" if steps and steps[-1].back else "failed"
        metrics.automatic_reset(chip.address, outcome)
        if outcome == "recovered":
            log.info("chip %s: %s brought it back", chip.address, steps[-1].rung, extra=fields)
        else:
            tried = ", ".join(step.rung for step in steps) or "no rung could run"
            log.error(
                "chip %s did not come back from any reset (%s); stop and start the VM",
                chip.address, tried, extra=fields)  # fmt: skip

    def _once(self, chip: Chip, message: str, fields: dict[str, str]) -> None:
        """A reason to leave the chip be, said when it is new (each tick would repeat it)."""
        if self._said.get(chip.address) != message:
            self._said[chip.address] = message
            log.warning("%s", message, extra=fields)
