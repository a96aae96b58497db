"""What each long-running part of `tpuboot run` is to the daemon: started, stopped, asked its Status.

The device side (:class:`tpuboot.devices.manager.DeviceManager`), the runtime-environment side
(:class:`tpuboot.env.service.EnvService`) and the supervised containers
(:class:`tpuboot.containers.service.Containers`) each own their state and say when it changed
through ``report()``; the daemon then reads ``status()`` and derives STATUS, the metrics it shows
and the guest attributes from that data, never from text (tpuboot/daemon.py has the rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

#: "My status changed": safe to call from any thread; the daemon reads ``status()`` on its loop.
Report = Callable[[], None]


@dataclass(frozen=True)
class Status:
    """A component's state (one word a program tests) and its detail (the words STATUS shows).

    ``state`` is a plain str here, so one type serves every component; each component's own
    states are a ``Literal`` alias in its module, and it builds its Status from a value of that
    type, where mypy checks them: :data:`tpuboot.devices.manager.ManagerState`,
    :data:`tpuboot.env.service.EnvState`, :data:`tpuboot.containers.service.ContainerState`
    (its supervisor's :data:`~tpuboot.containers.supervisor.SupervisedState` and one more),
    :data:`tpuboot.gce.guestattrs.PublisherState`, :data:`tpuboot.notices.service.NoticeState`.
    """

    state: str
    detail: str


class Component(Protocol):
    def start(self, report: Report) -> None:
        """Begin (on the daemon's loop); returns at once, the work goes on in the component's own
        threads or loop tasks. ``report`` is called after every change of ``status()``."""
        ...

    def stop(self) -> None:
        """End the work started (on the loop, once); what runs in threads is told to end."""
        ...

    def status(self) -> Status:
        """The state now; from any thread (an immutable value, replaced whole)."""
        ...
