"""What `tpuboot run` derives from its parts' state: the parts that observe the others.

Each is a part of the daemon (tpuboot/component.py) whose work is ``observe``: on the loop, after
every report, it reads the other parts' state and acts on it without blocking. All are after-boot
parts: the daemon makes them once READY=1 went out (tpuboot/daemon.py), so what they show starts
from READY.

- :class:`GuestAttributes`: this host's state as the guest attributes ``tpuboot/<key>`` show it,
  handed to the publisher (tpuboot/gce/guestattrs.py), which writes them from its own thread
  (the first values are READY's: no ``state=starting`` is written any more); at stop, the last word
  (``state=stopped`` and the values its pacing held back). Its tick sums up the TPUs' PCIe state
  from the tick's device snapshot, the reading recovery.automatic looks at too.
- :class:`TpuVmGate`: the containers start only on a TPU VM, once a TPU is present or tpu-env is
  held (an image-building VM has neither).
- :class:`VbarMark`: vBar's first run, the boot budget's last phase (READY's mark is the boot
  part's own: tpuboot/bootbudget.py's :class:`~tpuboot.bootbudget.BootBudget`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpuboot import __version__, bootbudget
from tpuboot.component import Part, Report
from tpuboot.containers.agents import VBAR
from tpuboot.containers.supervisor import RUNNING
from tpuboot.devices.health import summary
from tpuboot.eventloop import nothing

if TYPE_CHECKING:
    from tpuboot.containers.service import Containers
    from tpuboot.devices.manager import DeviceManager
    from tpuboot.devices.snapshot import DeviceSnapshot
    from tpuboot.env.service import EnvService
    from tpuboot.gce.guestattrs import Publisher
    from tpuboot.notices.service import Notices


def guest_attribute_values(
    devices: DeviceManager,
    pcie: str | None = None,
    env: EnvService | None = None,
    containers: Containers | None = None,
    notices: Notices | None = None,
) -> dict[str, str]:
    """This host's state as the guest attributes tpuboot/<key> show it (a part that is off: its key
    says so; ``pcie``: the TPUs' PCIe state in a word, None until read); on the loop, which owns
    the devices' state. ``state`` is ``ready``: the attributes are an after-boot part, shown from
    READY on (``stopped`` is the stop's last word)."""
    bound, present, failed = devices.counts()
    vbar = None if containers is None else containers.statuses().get(VBAR)
    shown = "" if pcie is None else f" pcie={pcie}"
    return {
        "state": "ready",
        "tpus": f"bound={bound} expected={present} failed={failed}{shown}",
        "tpu-env": "source=disabled" if env is None else env.attribute(),
        "vbar": "disabled" if vbar is None else vbar.detail,
        "version": __version__,
        "notice": "disabled" if notices is None else notices.attribute(),
    }


class GuestAttributes(Part):
    """The publisher fed :func:`guest_attribute_values` of the parts it is given."""

    name = "guest attributes"
    periodic = True

    def __init__(
        self,
        publisher: Publisher,
        devices: DeviceManager,
        env: EnvService | None = None,
        containers: Containers | None = None,
        notices: Notices | None = None,
    ) -> None:
        self.publisher = publisher
        self.devices = devices
        self._others = (env, containers, notices)
        self._pcie: str | None = None  # written by the tick only, replaced whole
        self._report: Report = nothing

    @property
    def pcie(self) -> str | None:
        """The TPUs' PCIe state at the last tick, in a word (from any thread); None: not read yet."""
        return self._pcie

    def values(self) -> dict[str, str]:
        return guest_attribute_values(self.devices, self._pcie, *self._others)

    def start(self, report: Report) -> None:
        """The publisher's thread, after READY (the daemon never hears of its Status, which STATUS
        does not show); the values come with the observe the daemon runs right after the start."""
        self._report = report
        self.publisher.start()

    def tick(self, devices: DeviceSnapshot) -> None:
        value = summary(devices.health.values())
        if value != self._pcie:  # an unchanged reading wakes nothing
            self._pcie = value
            self._report()  # the loop observes: the tpus attribute follows

    def observe(self, ready: bool) -> None:
        self.publisher.update(self.values())  # a lock, no I/O: the publisher writes in its thread

    def stop(self) -> None:
        """The last word, before the daemon closes the metadata client the publisher writes through."""
        self.publisher.stop(final={"state": "stopped"})


class TpuVmGate(Part):
    """Tells the containers this is a TPU VM (tpuboot/containers/service.py) once it is."""

    name = "TPU-VM gate"

    def __init__(self, containers: Containers, devices: DeviceManager, env: EnvService | None = None) -> None:
        self.containers = containers
        self.devices = devices
        self.env = env

    def observe(self, ready: bool) -> None:
        if self.devices.counts()[1]:
            self.containers.tpu_vm_seen("a TPU is present")
        elif self.env is not None and self.env.held:
            self.containers.tpu_vm_seen("tpu-env is held")


class VbarMark(Part):
    """vBar's first run marked in the boot budget: always after READY, since the containers start
    only then (READY never waits for them)."""

    name = "boot budget: vBar"

    def __init__(self, budget: bootbudget.BootBudget, containers: Containers) -> None:
        self.budget = budget
        self.containers = containers

    def observe(self, ready: bool) -> None:
        if self.budget.has(bootbudget.VBAR):
            return
        vbar = self.containers.statuses().get(VBAR)
        if vbar is not None and vbar.state == RUNNING:
            self.budget.mark(bootbudget.VBAR)
