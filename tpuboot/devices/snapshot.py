"""The devices as one round of the daemon's tick reads them: one snapshot, handed to every part.

The daemon makes one per round of its parts' tick work, in its pool (tpuboot/component.py), and
every part's ``tick`` gets the same one, so the round reads sysfs once however many parts look:
the TPU functions present with their drivers, IOMMU groups and nodes (tpuboot/devices/survey.py),
the chips they make (tpuboot/devices/chips.py) and each function's link and AER counters
(tpuboot/devices/health.py). Each reading is made when a part first asks for it and kept for the
round, so a round whose parts ask for nothing reads nothing. It belongs to the round's thread: a
part keeps what it needs of it, never the snapshot. Two readings stay their own, fresher than a
tick's: the CDI spec's, made after each device change, and the metrics endpoint's, at each scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

from tpuboot.devices.chips import Chip, chips_present
from tpuboot.devices.health import Health, read_healths
from tpuboot.devices.survey import TpuStatus, survey
from tpuboot.devices.vfio import Binder


class DeviceSnapshot:
    def __init__(self, binder: Binder) -> None:
        self.binder = binder

    @cached_property
    def tpus(self) -> tuple[TpuStatus, ...]:
        """Every function of the device table present, in address order (`tpuboot status`'s survey)."""
        return tuple(survey(self.binder))

    @cached_property
    def chips(self) -> tuple[Chip, ...]:
        """The functions grouped into chips, with their nodes."""
        return tuple(chips_present(self.binder.root, self.binder.table, self.tpus))

    @cached_property
    def health(self) -> Mapping[str, Health]:
        """Each function's PCIe link and AER counters, by address."""
        return read_healths(self.binder.root, (t.address for t in self.tpus))
