"""`tpuboot run`: the boot-time service. Watch first, then coldplug, then READY; sleep until told.

The daemon runs a list of parts (tpuboot/component.py's :class:`~tpuboot.component.Part`: start,
the tick's work, observe, stop, a Status) that tpuboot/wiring.py assembles, and knows none of them
by name: it starts them, ticks them, shows their Status and stops them by iterating the list. The
device manager is its own, outside the list: the loop owns it. The loop owns no polling: it wakes
for a udev event, a retry timer, the tick (the watchdog's beat, which hands the parts' tick work to
the pool), a part's report, or a signal. doc/architecture.md draws it.

The boot path: until READY, only what READY waits for is imported and runs (the devices, the CDI
spec a job ordered after tpuboot asks for, tpu-env and its files, the boot budget's READY mark):
the boot parts wiring made. Right after READY=1 went out, the daemon calls wiring's
:data:`~tpuboot.component.AfterBoot`, which imports and builds the rest (the containers, the
notices, the runtime collector, the guest attributes, recovery, vBar's relay, the metrics
endpoint); they join the list after the boot parts (STATUS's order, and the stop's), start,
observe and tick from then on. A stop asked before READY ends the daemon before they exist: the
stop touches only what ran. The gain is in doing less before READY, not in loading it cleverly.

The concurrency rule (one rule, kept everywhere):

- **The event loop** (tpuboot/eventloop.py, on the main thread) owns the daemon's state: READY,
  the device manager (every device's state, its retries and the udev monitor), the notifier, and
  the parts' ``observe`` (what they derive from the others: the guest attributes' values, the
  containers' TPU-VM gate, the boot budget's marks). Nothing on it blocks: no network, no file
  reading beyond sysfs attributes of one device, no waiting for a thread.
- **The worker pool** (``executor``) runs what the loop hands it: binds, /dev/vfio node fixes, the
  CDI spec's writes, and one round of the parts' ``tick`` at a time, each round over one snapshot
  of the devices (tpuboot/devices/snapshot.py: sysfs read once, however many parts look). Each
  future comes back to the loop by
  ``future.add_done_callback(lambda f: loop.call_soon_threadsafe(handler, f))``; the worker thread
  touches nothing else.
- **A part's own threads** do its blocking work: the runtime-environment side (tpu-env sync, then
  the watch; it also tells the containers to look at their image again), the containers (the GKE
  check, one supervisor per container), the guest-attribute publisher, the metrics server, vBar's
  relay, the notices (a watch per key and the hook runner, tpuboot/notices/), libtpu's runtime
  metrics (a poller only while a chip is held, tpuboot/runtime/). Each part owns its state and
  guards it with its own lock (or an Event); its ``status()`` returns an immutable
  :class:`~tpuboot.component.Status`, so any thread may read it.
- **Results come back by report**: a thread never touches the loop's state; it calls
  ``report()``, which is ``loop.call_soon_threadsafe(self._changed)``, and the loop then lets every
  part observe and derives STATUS and READY from the Statuses (metrics are derived where the state
  changes, from the same data).
- A flag shared between threads is a ``threading.Event`` or sits under a lock; the shared
  metadata client is thread-safe and closed once, by the daemon, after the last write.

A loop and threads both stay: the device side is many short, overlapping waits (binds, retry
timers, udev events) that a loop keeps in one thread without locks, while the other parts block
in libraries that have no event-loop form (requests, the Docker socket's event stream, waitpid).
The loop is our own, not asyncio (tpuboot/eventloop.py says why).
"""

from __future__ import annotations

import functools
import logging
import resource
import signal
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from tpuboot import __version__
from tpuboot import signals as meaning
from tpuboot.component import PENDING, AfterBoot, Part, Report, Status
from tpuboot.devices.manager import DeviceManager
from tpuboot.devices.snapshot import DeviceSnapshot
from tpuboot.eventloop import EventLoop, Timer, nothing
from tpuboot.notify import Notifier, watchdog_interval

if TYPE_CHECKING:
    from tpuboot.gce.client import MetadataClient

log = logging.getLogger("tpuboot.daemon")

#: The tick's pace when systemd asks for no watchdog (the tick is then only the parts' tick work).
TICK_INTERVAL = 30.0

P = TypeVar("P")


class Daemon:
    def __init__(
        self,
        loop: EventLoop,
        devices: DeviceManager,
        executor: ThreadPoolExecutor,
        notifier: Notifier,
        parts: Iterable[Part] = (),
        metadata: MetadataClient | None = None,
        after_boot: AfterBoot | None = None,
    ) -> None:
        self.loop = loop  # the device manager's too; serve() runs it once, then closes it
        self.devices = devices  # the loop's own part: first in STATUS, and what READY waits for first
        self.executor = executor
        self.notifier = notifier
        self.parts = list(parts)  # in STATUS's order: started, ticked, observing and stopped in it
        self.metadata = metadata  # shared by the parts that ask the server; closed at stop, once
        self.after_boot = after_boot  # the parts READY does not wait for: made right after it
        self.ready = False
        self.stopping = False  # STOPPING=1 sent: nothing shown changes any more
        self._stop_asked = threading.Event()  # by a signal or request_stop, from any thread
        self._tick_timer: Timer | None = None
        self._check: Future[None] | None = None  # the parts' tick work handed to the pool last
        self._signal_log = meaning.SignalLog()
        self._debug_from: int | None = None  # the level SIGUSR2 turned debug logging on from

    def part(self, kind: type[P]) -> P | None:
        """The part of type ``kind`` the daemon runs, if it runs one (the tests; an after-boot part
        only once READY went out)."""
        return next((part for part in self.parts if isinstance(part, kind)), None)

    def serve(self, *, signals: bool = True) -> int:
        """Run on this thread until SIGTERM, SIGINT or :meth:`request_stop`; returns the exit status.

        ``signals`` (the default, and only from the main thread): each signal gets the meaning
        tpuboot/signals.py gives it. The tests that serve it in a thread of their own pass False
        and stop it by request.
        """
        try:
            if signals:
                self._take_signals()
            return self.run()
        finally:
            self.loop.close()  # gives the signals back

    def _take_signals(self) -> None:
        for sig in meaning.STOP:
            self.loop.add_signal_handler(sig, functools.partial(self._on_stop_signal, sig))
        for ignored in meaning.IGNORED:
            self.loop.add_signal_handler(ignored, functools.partial(self._on_ignored_signal, ignored))
        self.loop.add_signal_handler(signal.SIGUSR1, self.dump_state)
        self.loop.add_signal_handler(signal.SIGUSR2, self.toggle_debug)
        self.loop.add_signal_handler(signal.SIGQUIT, self.dump_stacks)

    def request_stop(self) -> None:
        """From any thread: stop as SIGTERM does."""
        self._stop_asked.set()
        self.loop.call_soon_threadsafe(nothing)  # wakes the loop to look

    def _on_stop_signal(self, sig: int) -> None:
        if not self.stopping:
            log.info("%s: stopping", signal.Signals(sig).name, extra={"SIGNAL": signal.Signals(sig).name})
            self.request_stop()
            return
        self._signal_log.log(
            sig, logging.WARNING, "already stopping; ignored (the stop ends within %g s)", meaning.STOP_BUDGET
        )

    def _on_ignored_signal(self, sig: int) -> None:
        self._signal_log.log(sig, logging.WARNING, "%s", meaning.IGNORED[signal.Signals(sig)])

    def dump_state(self) -> None:
        """SIGUSR1: what the daemon is doing, to the journal (one line per part)."""
        sig = signal.SIGUSR1
        more = self._signal_log.due(sig)
        if more is None:
            return
        state = "stopping" if self.stopping else "ready" if self.ready else "starting"
        fields = {"SIGNAL": "SIGUSR1"}
        log.info("SIGUSR1: %s, tpuboot %s%s", state, __version__, more, extra=fields)
        for part in self.statuses():
            log.info("SIGUSR1: %s: %s", part.state, part.detail, extra=fields)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        said = "".join(f", {words}" for words in (part.dump() for part in self.parts) if words)
        log.info("SIGUSR1: threads %d, peak RSS %d KiB%s", threading.active_count(), peak, said, extra=fields)

    def dump_stacks(self) -> None:
        """SIGQUIT: every thread's Python stack to the journal, one record per thread."""
        more = self._signal_log.due(signal.SIGQUIT)
        if more is None:
            return
        stacks = meaning.thread_stacks()
        log.info("SIGQUIT: the stacks of %d threads follow%s", len(stacks), more, extra={"SIGNAL": "SIGQUIT"})
        for name, stack in stacks:
            log.info("SIGQUIT: thread %s:\n%s", name, stack, extra={"SIGNAL": "SIGQUIT", "THREAD": name})

    def toggle_debug(self) -> None:
        """SIGUSR2: debug logging on, or back to the level it was turned on from; one toggle per
        LOG_INTERVAL at most (more within it are counted and ignored, so a storm cannot flap it)."""
        more = self._signal_log.due(signal.SIGUSR2)
        if more is None:
            return
        logger = logging.getLogger("tpuboot")
        if self._debug_from is None:
            self._debug_from = logger.level
            logger.setLevel(logging.DEBUG)
            said = "debug logging on (SIGUSR2 again: off)"
        else:
            logger.setLevel(self._debug_from)
            self._debug_from = None
            said = "debug logging off"
        ignored = more.replace(" since", ", ignored, since")
        log.info("SIGUSR2: %s%s", said, ignored, extra={"SIGNAL": "SIGUSR2"})

    # ------------------------------------------------------------------ derived from Status

    def statuses(self) -> list[Status]:
        """The devices' Status, then each part's that has a line, in STATUS's order."""
        shown = (part.status() for part in self.parts)
        return [self.devices.status(), *(status for status in shown if status is not None)]

    def status_line(self) -> str:
        return "; ".join(s.detail for s in self.statuses() if s.detail)  # a quiet part says nothing

    def _changed(self) -> None:
        """On the loop, after any part's report (the devices' in the turn of their change): every
        part observes, then STATUS follows the Statuses."""
        if self.stopping:
            return  # STATUS=stopping stays, and the guest attributes have had their last word
        self._observe()
        if self.ready:
            self.notifier.status(self.status_line())

    def _observe(self) -> None:
        for part in self.parts:
            part.observe(self.ready)

    def _booted(self) -> bool:
        """What READY waits for: the devices settled (DeviceManager.booted) and no part pending
        (the boot-time tpu-env sync). Checked by the loop after every round, so no change is missed."""
        shown = (part.status() for part in self.parts)
        return self.devices.booted() and not any(s is not None and s.state == PENDING for s in shown)

    # ------------------------------------------------------------------ the loop

    def _tick(self, interval: float, watchdog: bool) -> None:
        """Now and every ``interval``, the loop's only periodic wake-up: WATCHDOG=1 when systemd
        asked for it, and the parts' tick work. Re-armed first, so nothing the send or a tick does
        can end the watchdog."""
        self._tick_timer = self.loop.call_later(interval, self._tick, interval, watchdog)
        if watchdog:
            self.notifier.watchdog()
        self._periodic_checks()

    def _periodic(self) -> list[Part]:
        return [part for part in self.parts if part.periodic]

    def _periodic_checks(self) -> None:
        """The parts' tick work (an agent's endpoint probed, the TPUs' PCIe state read and wedged
        chips reset, the chips' holders looked at), in the pool (a connect may wait, a reset takes
        seconds); one round at a time, so a slow one is never queued behind itself. Results come
        back by report, or through the udev events a reset causes."""
        if self.stopping or not self._periodic():
            return
        if self._check is not None and not self._check.done():
            return
        self._check = self.executor.submit(self._periodic_work)

    def _periodic_work(self) -> None:
        """One round of the parts' tick work (in the pool), over one snapshot of the devices; a bug
        in one is logged, never lost in its future, and the others still run."""
        devices = DeviceSnapshot(self.devices.binder)  # read as the parts ask, once a round
        for part in self._periodic():
            try:
                part.tick(devices)
            except Exception:
                log.exception("periodic check %s failed; please report it", part.name)

    def run(self) -> int:
        """Start the boot parts, READY once booted, then the after-boot parts, and serve until
        stopped (on the loop's thread)."""
        loop = self.loop

        def report() -> None:  # from any thread: the loop reads the Statuses
            loop.call_soon_threadsafe(self._changed)

        self.devices.start(self._changed)  # on the loop: coldplug before any udev event binds
        for part in self.parts:
            part.start(report)  # READY never waits for a part's threads, only for its PENDING
        interval = watchdog_interval()
        if interval or self._periodic():
            self._tick(interval or TICK_INTERVAL, watchdog=bool(interval))
        self._changed()
        asked = self._stop_asked.is_set
        try:
            # SIGTERM during a long boot (metadata server down) ends this wait: no deadline to sit out.
            loop.run_until(lambda: asked() or self._booted())
            if not asked():
                line = self.status_line()
                log.info("ready: %s", line)
                self.notifier.ready(line)
                self.ready = True  # after READY=1 went out: a thread that sees it sees that too
                self._observe()  # READY's own: the boot budget's line
                if not asked():
                    self._start_after_boot(report)
                loop.run_until(asked)
        finally:
            self.stopping = True
            self.notifier.stopping()
            log.info("stopping")
            self._stop()
            if self._tick_timer is not None:
                self._tick_timer.cancel()
        return 0

    def _start_after_boot(self, report: Report) -> None:
        """Right after READY=1: the parts READY does not wait for, made now (their modules are
        imported only now), appended to the list, started, ticked (a first round at once, as the
        boot parts had theirs at start; the tick armed if it was not) and observing; STATUS then
        shows every part."""
        if self.after_boot is None:
            return
        later = self.after_boot()
        self.parts += later
        for part in later:
            part.start(report)
        if self._tick_timer is None and self._periodic():
            self._tick(TICK_INTERVAL, watchdog=False)
        else:
            self._periodic_checks()
        self._changed()  # the TPUs coldplug found open the containers' gate at once

    def _stop(self) -> None:
        """The devices let go on the loop (their reader and timers are its own); the parts end in a
        thread while the loop runs on (the watchdog, and the signals' meanings: a second SIGTERM
        is logged and ignored), for :data:`~tpuboot.signals.STOP_BUDGET` at most."""
        self.devices.stop()
        done = threading.Event()

        def stop_parts() -> None:
            try:
                self._stop_parts()
            except Exception:  # a bug: the stop still ends, and says so
                log.exception("stop: unexpected error; stopping all the same, please report it")
            finally:
                done.set()
                self.loop.call_soon_threadsafe(nothing)

        overdue = threading.Event()
        timer = self.loop.call_later(meaning.STOP_BUDGET, overdue.set)
        threading.Thread(target=stop_parts, name="tpuboot-stop", daemon=True).start()
        self.loop.run_until(lambda: done.is_set() or overdue.is_set())
        timer.cancel()
        if not done.is_set():
            log.error(
                "stop: still not finished after %g s; exiting all the same (%s)",
                meaning.STOP_BUDGET, ", ".join(t.name for t in threading.enumerate()))  # fmt: skip

    def _stop_parts(self) -> None:
        """Every part told to end, in the list's order: first those that may still write through the
        shared metadata client (the guest attributes' last word), then the client closed (which
        cuts a fetch, a long-poll or a GKE check in flight), then the parts that stop after it.
        Each wait here has a bound of its own; STOP_BUDGET bounds them together."""
        for part in self.parts:
            if not part.stops_after_metadata:
                part.stop()
        if self.metadata is not None:
            self.metadata.close()
        for part in self.parts:
            if part.stops_after_metadata:
                part.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
