"""The daemon's device side: bind every TPU present or added (udev), retry what may be transient,
keep count. Everything here runs on the daemon's event loop (tpuboot/eventloop.py); binds run in
its worker pool, and each bind's future comes back to the loop through ``call_soon_threadsafe``."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Literal, Protocol

from tpuboot import bootbudget, metrics
from tpuboot.backoff import Backoff
from tpuboot.component import Report, Status
from tpuboot.config import ReadyConfig
from tpuboot.devices.pci import PciFunction, list_addresses
from tpuboot.devices.udev import Coldplug
from tpuboot.devices.vfio import Binder, BindResult, DeviceGoneError, group_node, os_failure
from tpuboot.errors import TpubootError
from tpuboot.eventloop import EventLoop, Timer, nothing
from tpuboot.numbers import ascii_int

log = logging.getLogger("tpuboot.devices.manager")

BACKOFF_FIRST = 1.0
BACKOFF_CAP = 60.0


def retry_delay(failures: int) -> float:
    """Seconds before the next try of a bind that failed ``failures`` times in a row: doubling
    from BACKOFF_FIRST, at most BACKOFF_CAP (the README and the man page quote the schedule)."""
    return Backoff(BACKOFF_FIRST, BACKOFF_CAP, floor=0.0).ceiling(failures - 1)


#: A function whose PCI ids could not be read: maybe a TPU; STATUS lists it apart from the TPUs.
UNCLASSIFIED = "unclassified PCI function"


class UdevDevice(Protocol):
    """What is read of a udev event (a pyudev.Device)."""

    action: str | None
    subsystem: str | None
    sys_name: str


class Monitor(Protocol):
    """What is used of a udev monitor (a pyudev.Monitor; tests feed their own)."""

    def fileno(self) -> int: ...
    def poll(self, timeout: float | None = None) -> UdevDevice | None: ...


#: Where one device is: a bind pending (or running), bound, failed, or the device removed.
DeviceLifecycle = Literal["pending", "bound", "failed", "removed"]
#: The manager's state (Status.state): ``bound`` (every TPU), ``binding`` (one pending),
#: ``failed`` (one failed, none pending) or ``none`` (no TPU).
ManagerState = Literal["bound", "binding", "failed", "none"]


@dataclass
class DeviceState:
    kind: str
    state: DeviceLifecycle = "pending"
    error: str | None = None
    attempts: int = 0
    running: bool = False
    retry: Timer | None = None
    traceback_logged: bool = False  # an unexpected exception's traceback is logged once per device


class DeviceManager:
    """Owns the state of every managed device; all methods run on the event loop thread.

    The loop's own part (tpuboot/component.py; outside the daemon's list): ``start`` adopts the
    binds coldplug started (tpuboot run submits them before the loop runs) and listens to
    ``monitor``; ``booted`` is what READY waits for.
    """

    def __init__(
        self,
        loop: EventLoop,
        binder: Binder,
        executor: Executor,
        monitor: Monitor,
        coldplug: Coldplug,
        ready: ReadyConfig | None = None,
        follow: Report = nothing,
    ) -> None:
        """``follow``: what must follow every change in its own turn, before the report (the CDI spec)."""
        self.loop = loop
        self.binder = binder
        self.executor = executor
        self.monitor = monitor
        self.coldplug = coldplug  # the devices present and the binds started before the loop
        self.ready_config = ready or ReadyConfig()
        self.follow = follow
        self.on_change: Report = nothing
        self.devices: dict[str, DeviceState] = {}
        self._first: set[Future[BindResult]] = set()  # coldplug's binds: READY waits for their first try
        self._at_start: list[str] = []  # the devices present at start (ready.wait_for_devices)
        self._deadline: Timer | None = None  # ready.device_deadline, once the first tries ended
        self._deadline_passed = False
        self._listening = False

    # ------------------------------------------------------------------ the part

    def start(self, report: Report) -> None:
        """Bind every matching device already present (adopting binds already running), then listen;
        the monitor was started before the enumeration, so no device falls between the two."""
        self.on_change = report
        early = self.coldplug
        binds = (self.consider(a, early.binds.get(a), early.started) for a in early.addresses)
        self._first = {b for b in binds if b is not None}  # before any udev event starts a bind
        self._at_start = list(self.devices)  # the TPUs present (and the functions not yet classified)
        self.loop.add_reader(self.monitor.fileno(), self._on_udev)
        self._listening = True
        if not self._first:
            self._first_tries_ended()

    def booted(self) -> bool:
        """Whether READY may come as far as the devices go: each coldplugged TPU's first bind ended;
        with ready.wait_for_devices, every TPU present at start is also bound or failed for good, or
        ready.device_deadline has passed since the first binds ended."""
        if self._first:
            return False
        return not self.ready_config.wait_for_devices or self._deadline_passed or self.settled(self._at_start)

    def _first_tries_ended(self) -> None:
        if self.ready_config.wait_for_devices and not self.settled(self._at_start):
            self._deadline = self.loop.call_later(self.ready_config.device_deadline, self._device_deadline)

    def _device_deadline(self) -> None:
        self._deadline = None
        if self.settled(self._at_start):
            return
        self._deadline_passed = True
        bound, present, _ = self.counts()
        log.warning(
            "ready: %d of %d TPUs bound after %g s (ready.device_deadline); READY now, retries go on",
            bound, present, self.ready_config.device_deadline)  # fmt: skip

    def stop(self) -> None:
        if self._listening:
            self.loop.remove_reader(self.monitor.fileno())
            self._listening = False
        self.binder.stop.set()
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        for state in self.devices.values():
            self._cancel_retry(state)

    def status(self) -> Status:
        """``bound`` (every TPU), ``binding`` (one pending), ``failed`` (one failed, none pending) or
        ``none`` (no TPU); the detail is :meth:`summary`."""
        states = {s.state for s in self.devices.values() if s.state != "removed"}
        state: ManagerState = (
            "binding" if "pending" in states else "failed" if "failed" in states else "bound"
        )
        return Status(state if states else "none", self.summary())

    # ------------------------------------------------------------------ udev

    def _on_udev(self) -> None:
        try:
            while (device := self.monitor.poll(timeout=0)) is not None:
                self.dispatch(device)
        except OSError as exc:
            if exc.errno != errno.ENOBUFS:
                raise
            self.rescan()

    def rescan(self) -> None:
        """The kernel dropped events the monitor's buffer had no room for (ENOBUFS): what they said
        is read from sysfs instead, as at start. Binding a bound TPU only verifies it."""
        try:
            present = set(list_addresses(self.binder.root))
        except OSError as exc:
            log.error("udev: events were lost and the PCI devices cannot be listed (%s)", exc)
            return
        log.warning("udev: events were lost (receive buffer full); reading the %d PCI devices again",
                    len(present))  # fmt: skip
        for address, state in list(self.devices.items()):
            if address not in present and state.state != "removed":
                self.removed(address)
        for address in sorted(present):
            self.consider(address)

    def dispatch(self, device: UdevDevice) -> None:
        if device.subsystem == "vfio":
            if device.action == "add" and ascii_int(device.sys_name) is not None:
                self.node_appeared(device.sys_name)
        elif device.action == "add":
            self.consider(device.sys_name)
        elif device.action == "remove":
            self.removed(device.sys_name)
        elif device.action in ("bind", "unbind") and self._driver_changed_by_others(device.sys_name):
            self._changed()  # a driver came or went (`tpuboot unbind`): the CDI spec follows

    def _driver_changed_by_others(self, address: str) -> bool:
        """A managed device's driver changed outside a bind of ours (whose end reports itself:
        reporting its udev ``bind`` too would refresh the CDI spec before the node is ready)."""
        state = self.devices.get(address)
        return state is not None and not state.running

    # ------------------------------------------------------------------ binding

    def consider(
        self, address: str, early: Future[BindResult] | None = None, started: float = 0.0
    ) -> Future[BindResult] | None:
        """Start binding ``address`` if it is a managed TPU; returns the bind's future, if any.

        ``early`` is a bind coldplug already submitted (at monotonic ``started``): adopted, not redone.
        Never raises: a device that cannot even be classified is that device's failure, and an
        unexpected exception is logged, so neither the udev callback nor coldplug can end the daemon.
        """
        try:
            return self._consider(address, early, started, retry=False)
        except Exception:
            log.exception("%s: unexpected error; please report it", address, extra={"DBDF": address})
            return None

    def _consider(
        self, address: str, early: Future[BindResult] | None, started: float, *, retry: bool
    ) -> Future[BindResult] | None:
        fn = PciFunction(self.binder.root, address)
        state = self.devices.get(address)
        if state is not None and state.state == "removed":
            state = None
        if state is not None and state.running:
            return None  # the running bind will see the device as it is now
        try:
            kind = self.binder.kind_of(fn)
        except FileNotFoundError:
            return None  # gone again, or not a full PCI function
        except OSError as exc:
            if early is None:
                self._unclassified(address, state, os_failure(address, "reading its PCI ids", exc), retry)
                return None
            kind_name = "TPU"  # coldplug read its ids a moment ago and found a TPU: adopt its bind
        else:
            if kind is None or not kind.vfio:
                if state is not None and state.kind == UNCLASSIFIED:  # its ids are readable now
                    self._cancel_retry(state)
                    del self.devices[address]
                    self._changed()
                return None
            kind_name = kind.name
        if state is None or state.kind == UNCLASSIFIED:
            state = self.devices[address] = DeviceState(kind_name)
        self._cancel_retry(state)
        state.attempts = 0  # a new event earns a fresh series of retries
        return self._start(address, state, early, started)

    def _unclassified(self, address: str, state: DeviceState | None, exc: TpubootError, retry: bool) -> None:
        """The ids of ``address`` are unreadable: show it failed, and retry the reading if transient."""
        if state is None:
            state = self.devices[address] = DeviceState(UNCLASSIFIED)
        self._cancel_retry(state)
        if not retry:
            state.attempts = 0
        state.attempts += 1
        self._failed(address, state, exc, {"DBDF": address, "TPU_KIND": state.kind}, self._reconsider)
        self._changed()

    def _reconsider(self, address: str, state: DeviceState) -> None:
        """A retry's timer, on the loop: the loop logs a bug here with its traceback and goes on."""
        state.retry = None
        if self.devices.get(address) is state:
            self._consider(address, None, 0.0, retry=True)

    def _start(
        self, address: str, state: DeviceState, early: Future[BindResult] | None = None, started: float = 0.0
    ) -> Future[BindResult] | None:
        """Bind ``address`` in the worker pool (or adopt ``early``, already there); its result comes
        back to :meth:`_bound` on the loop."""
        state.attempts += 1
        state.state = "pending"
        state.running = True
        self._count()
        if early is None:
            started = time.monotonic()
            try:
                early = self.executor.submit(self.binder.bind, address)
            except RuntimeError:  # the pool is shut down: the daemon is stopping
                state.running = False
                return None
        back = self.loop.call_soon_threadsafe
        early.add_done_callback(lambda f: back(self._bound, address, state, f, started))
        return early

    def _bound(self, address: str, state: DeviceState, future: Future[BindResult], started: float) -> None:
        """On the loop: a bind ended (in the pool, or coldplug's adopted)."""
        state.running = False
        unexpected: BaseException | None = None
        try:
            result = future.result()
        except TpubootError as exc:
            outcome: BindResult | TpubootError = exc
        except FileNotFoundError:  # unplugged while we worked on it
            outcome = DeviceGoneError(f"{address}: removed during bind")
        except OSError as exc:  # Binder names its OSErrors; this is a bind run by other code
            outcome = os_failure(address, "bind", exc)
        except Exception as exc:  # a bug: this device's failure, never the loop's end
            unexpected = exc
            outcome = TpubootError(
                f"{address}: unexpected {type(exc).__name__} in bind ({exc}); please report it with the log"
            )
        else:
            outcome = result
        metrics.bind_attempt(metrics.bind_result(outcome), time.monotonic() - started)
        try:
            self._outcome(address, state, outcome, unexpected)
        finally:  # whatever happened, this first try has ended: READY must not wait for it
            if future in self._first:
                self._first.discard(future)
                if not self._first:
                    self._first_tries_ended()

    def _outcome(
        self,
        address: str,
        state: DeviceState,
        outcome: BindResult | TpubootError,
        unexpected: BaseException | None,
    ) -> None:
        if self.devices.get(address) is not state or state.state == "removed":
            return  # removed meanwhile; the removal was logged
        fields = {"DBDF": address, "TPU_KIND": state.kind}
        if unexpected is not None and not state.traceback_logged:
            state.traceback_logged = True
            log.error("%s: unexpected error in bind", address, exc_info=unexpected, extra=fields)
        if isinstance(outcome, BindResult):
            state.state, state.error = "bound", None
            how = "bound to vfio-pci" if outcome.changed else "already bound to vfio-pci"
            bootbudget.mark(bootbudget.BIND, address)
            extra = {**fields, "IOMMU_GROUP": outcome.group, "VFIO_NODE": outcome.node}
            log.info("%s (%s) %s, %s ready", address, state.kind, how, outcome.node, extra=extra)
        else:
            self._failed(address, state, outcome, fields)
        self._changed()

    def _failed(
        self,
        address: str,
        state: DeviceState,
        exc: TpubootError,
        fields: dict[str, str],
        again: Callable[[str, DeviceState], None] | None = None,
    ) -> None:
        state.state, state.error = "failed", str(exc)
        retries = self.binder.config.retries
        if exc.transient and state.attempts <= retries:
            delay = retry_delay(state.attempts)
            log.warning("%s (retry %d/%d in %.0f s)", exc, state.attempts, retries, delay, extra=fields)
            state.retry = self.loop.call_later(delay, again or self._retry, address, state)
        else:
            log.error("%s", exc, extra=fields)

    def _retry(self, address: str, state: DeviceState) -> None:
        state.retry = None
        if self.devices.get(address) is state:
            self._start(address, state)

    def removed(self, address: str) -> None:
        state = self.devices.get(address)
        if state is None or state.state == "removed":
            return
        self._cancel_retry(state)
        state.state = "removed"
        log.info("%s (%s) removed", address, state.kind, extra={"DBDF": address, "TPU_KIND": state.kind})
        self._changed()

    def _changed(self) -> None:
        self._count()
        if self._deadline is not None and self.settled(self._at_start):
            self._deadline.cancel()  # settled in time: no wake-up at the deadline
            self._deadline = None
        self.follow()
        self.on_change()

    def _count(self) -> None:
        metrics.tpus((s.kind, s.state) for s in self.devices.values() if s.state != "removed")

    def node_appeared(self, group: str) -> None:
        """udev finished a /dev/vfio/<group> node: re-apply our mode in case a rule changed it."""
        try:
            mode = os.stat(self.binder.root.path(group_node(group))).st_mode & 0o7777
        except FileNotFoundError:
            return  # gone again (unbound); nothing to fix
        except OSError as exc:
            log.warning("%s", os_failure(f"IOMMU group {group}", f"reading {group_node(group)}", exc),
                        extra={"IOMMU_GROUP": group})  # fmt: skip
            return
        if mode == self.binder.config.node_mode:
            return  # the bind that made it already set the mode: no second trip through the pool
        try:
            future = self.executor.submit(self.binder.prepare_node, group)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            return
        back = self.loop.call_soon_threadsafe
        future.add_done_callback(lambda f: back(self._node_done, group, f))

    @staticmethod
    def _node_done(group: str, future: Future[str]) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            log.warning("%s: %s", group_node(group), exc, extra={"IOMMU_GROUP": group})

    @staticmethod
    def _cancel_retry(state: DeviceState) -> None:
        if state.retry is not None:
            state.retry.cancel()
            state.retry = None

    def settled(self, addresses: Iterable[str]) -> bool:
        """Whether each of ``addresses`` is bound, gone, not a TPU after all, or failed for good
        (a permanent error, or its retries spent): nothing running and no retry pending."""
        for address in addresses:
            state = self.devices.get(address)
            if state is None or state.state in ("bound", "removed"):
                continue
            if state.state == "failed" and state.retry is None and not state.running:
                continue
            return False
        return True

    def counts(self) -> tuple[int, int, int]:
        """(bound, present, failed) TPUs, as STATUS counts them (functions not yet classified apart)."""
        present = [s for s in self.devices.values() if s.state != "removed" and s.kind != UNCLASSIFIED]
        bound = sum(1 for s in present if s.state == "bound")
        return bound, len(present), sum(1 for s in present if s.state == "failed")

    def summary(self) -> str:
        """One line for STATUS: how many TPUs are bound, and the first failure."""
        known = {a: s for a, s in self.devices.items() if s.state != "removed"}
        present = {a: s for a, s in known.items() if s.kind != UNCLASSIFIED}
        bound = sum(1 for s in present.values() if s.state == "bound")
        failed = [(a, s) for a, s in known.items() if s.state == "failed"]
        if not known:
            return "no TPUs found"
        noun = "TPU" if len(present) == 1 else "TPUs"
        line = (
            f"{bound} {noun} bound to vfio-pci"
            if bound == len(present)
            else (f"{bound} of {len(present)} {noun} bound to vfio-pci")
        )
        if not present:
            line = "no TPUs found"
        if failed:
            first = failed[0][1].error or "failed"
            more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
            line += f"; {first}{more}"
        return line
