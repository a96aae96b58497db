"""What a part of `tpuboot run` is to the daemon: one small interface every feature sits behind.

tpuboot/wiring.py builds the daemon's parts and hands them over in two lists: the boot parts, made
before READY because READY waits for them (the CDI spec, tpu-env, the boot budget's READY mark),
and :data:`AfterBoot`, which makes the others (the containers, the notices, the guest attributes,
the metrics endpoint...) once READY=1 went out, so the boot neither imports nor starts them.
tpuboot/daemon.py starts them, ticks them, shows their Status and stops them by iterating one
list, the after-boot parts appended to the boot ones, with no knowledge of what each one does (as
google-guest-agent runs its managers). A new feature is one module with a :class:`Part` and one
line in one of wiring's lists (tests/unit/test_parts.py adds one). The device manager is the one
part outside the lists: the loop owns it (tpuboot/daemon.py says why).

Each part owns its state and says when it changed through ``report()``; the daemon then reads
``status()`` and derives STATUS, READY and what the parts that ``observe`` show from that data,
never from text (tpuboot/daemon.py has the rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

#: "My status changed": safe to call from any thread; the daemon reads ``status()`` on its loop.
Report = Callable[[], None]
#: What a part's tick is handed: the round's :class:`tpuboot.devices.snapshot.DeviceSnapshot`, which
#: each part's ``tick`` names; unnamed here, so this module, which the sub-packages import, imports
#: none of them (tests/unit/repo/test_import_graph.py).
Devices = Any


@dataclass(frozen=True)
class Status:
    """A part's state (one word a program tests) and its detail (the words STATUS shows).

    ``state`` is a plain str here, so one type serves every part; each part's own states are a
    ``Literal`` alias in its module, and it builds its Status from a value of that type, where mypy
    checks them: :data:`tpuboot.devices.manager.ManagerState`, :data:`tpuboot.env.service.EnvState`,
    :data:`tpuboot.containers.service.ContainerState` (its supervisor's
    :data:`~tpuboot.containers.supervisor.SupervisedState` and one more),
    :data:`tpuboot.gce.guestattrs.PublisherState`, :data:`tpuboot.notices.service.NoticeState`.
    """

    state: str
    detail: str


#: The state of a part whose boot-time work has not ended: READY waits while any part is in it
#: (tpu-env's boot sync is; a part that never holds READY never takes it).
PENDING: Final = "pending"


class Part(Protocol):
    """One feature of the daemon. Subclass it (its defaults are those of a part with nothing to do
    there) and set what applies; the daemon calls each method from the thread its text names.

    The stop runs in the list's order in two rounds around the close of the shared metadata
    client (which cuts any call in flight): the parts with :attr:`stops_after_metadata` after it.
    """

    #: Its name in the journal (a tick that failed).
    name: str
    #: Stopped after the shared metadata client is closed: its stop waits for threads a metadata
    #: call may hold (the close cuts the call), or it should outlast those. Before it, the rest: a
    #: call the close cuts then reads as the stop, and a last write still goes out.
    stops_after_metadata: bool = False

    def start(self, report: Report) -> None:
        """Begin (on the daemon's loop); returns at once, the work goes on in the part's own threads
        or in the pool. ``report`` is called after every change of ``status()`` or of what the
        parts that observe read of it."""
        return None

    def status(self) -> Status | None:
        """The state now, from any thread (an immutable value, replaced whole); None: no line in
        STATUS (and never :data:`PENDING`)."""
        return None

    @property
    def periodic(self) -> bool:
        """Whether the part has tick work: with none anywhere, and no watchdog, the daemon never ticks."""
        return False

    def tick(self, devices: Devices) -> None:
        """The part's work at each tick, in the daemon's pool (it may block: a probe, a reset);
        one round at a time, so it never overlaps itself. ``devices``: the round's one reading of
        the devices, shared by every part's tick. Results come back by ``report``."""
        return None

    def observe(self, ready: bool) -> None:
        """On the loop, right after the parts start (the boot parts, then the after-boot ones),
        after any part's report and at READY (``ready`` then and after): derive what this part
        shows or opens from the others' state. Never blocks."""
        return None

    def dump(self) -> str | None:
        """A few words for SIGUSR1's dump beyond the Status (``metrics connections 2``), from the
        loop; None: nothing more to say."""
        return None

    def stop(self) -> None:
        """End the work started (from the daemon's stop thread, once); each wait has its own bound."""
        return None


#: The after-boot parts' maker (tpuboot/wiring.py's): the daemon calls it once, on its loop, right
#: after READY=1 went out, and never when a stop was asked first; it imports and builds the parts
#: READY does not wait for, in STATUS's order, and the daemon appends them to the boot parts and
#: starts them.
AfterBoot = Callable[[], list[Part]]
