"""What `tpuboot run` derives from its parts' state: the parts that observe the others.

Each is a part of the daemon (tpuboot/component.py) whose work is ``observe``: on the loop, after
every report and at READY, it reads the other parts' state and acts on it without blocking.

- :class:`GuestAttributes`: this host's state as the guest attributes ``tpuboot/<key>`` show it,
  handed to the publisher (tpuboot/gce/guestattrs.py), which writes them from its own thread; at
  stop, the last word (``state=stopped`` and the values its pacing held back). Its tick sums up the
  TPUs' PCIe state from the tick's device snapshot, the reading recovery.automatic looks at too.
- :class:`TpuVmGate`: the containers start only on a TPU VM, once a TPU is present or tpu-env is
  held (an image-building VM has neither).
- :class:`BootBudget`: READY's mark and the budget's journal line, then vBar's first run as the
  boot's last phase (tpuboot/bootbudget.py); each published as metrics and, from the pool, to
  /run/tpuboot/boot.json.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpuboot import __version__, bootbudget, metrics
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

log = logging.getLogger("tpuboot.daemon")


def guest_attribute_values(
    ready: bool,
    devices: DeviceManager,
    pcie: str | None = None,
    env: EnvService | None = None,
    containers: Containers | None = None,
    notices: Notices | None = None,
) -> dict[str, str]:
    """This host's state as the guest attributes tpuboot/<key> show it (a part that is off: its key
    says so; ``pcie``: the TPUs' PCIe state in a word, None until read); on the loop, which owns
    the devices' state."""
    bound, present, failed = devices.counts()
    vbar = None if containers is None else containers.statuses().get(VBAR)
    shown = "" if pcie is None else f" pcie={pcie}"
    return {
        "state": "ready" if ready else "starting",
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

    def values(self, ready: bool) -> dict[str, str]:
        return guest_attribute_values(ready, self.devices, self._pcie, *self._others)

    def start(self, report: Report) -> None:
        """The state at start, then the publisher's thread: READY never waits for it (nor does the
        daemon hear of its Status, which STATUS does not show)."""
        self._report = report
        self.publisher.update(self.values(False))
        self.publisher.start()

    def tick(self, devices: DeviceSnapshot) -> None:
        value = summary(devices.health.values())
        if value != self._pcie:  # an unchanged reading wakes nothing
            self._pcie = value
            self._report()  # the loop observes: the tpus attribute follows

    def observe(self, ready: bool) -> None:
        self.publisher.update(self.values(ready))  # a lock, no I/O: the publisher writes in its thread

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


class BootBudget(Part):
    """The daemon's marks in the boot budget; ``submit`` hands its file write to the pool."""

    name = "boot budget"

    def __init__(
        self,
        budget: bootbudget.Budget,
        submit: Callable[[Callable[[], None]], object],
        containers: Containers | None = None,
    ) -> None:
        self.budget = budget
        self.submit = submit
        self.containers = containers

    def observe(self, ready: bool) -> None:
        if ready and not self.budget.has(bootbudget.READY):
            self.budget.mark(bootbudget.READY)
            self._vbar()  # running already: said in this line too
            log.info("%s", self.budget.summary(), extra=self.budget.journal_fields())
            self._publish()
        else:
            self._vbar()

    def _vbar(self) -> None:
        """vBar's first run ends the budget's last phase (after READY, which never waits for it)."""
        if self.containers is None or self.budget.has(bootbudget.VBAR):
            return
        vbar = self.containers.statuses().get(VBAR)
        if vbar is not None and vbar.state == RUNNING:
            self.budget.mark(bootbudget.VBAR)
            self._publish()

    def _publish(self) -> None:
        """The budget as metrics, and to /run/tpuboot/boot.json from the pool (a file write)."""
        metrics.boot_phases(self.budget.phases())
        self.submit(self.budget.save)
