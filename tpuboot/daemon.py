"""`tpuboot run`: the boot-time service. Watch first, then coldplug, then READY; sleep until told.

The loop owns no polling: it wakes for a udev event, a retry timer, the tick (the watchdog's beat,
which hands the periodic checks to the pool), a component's report, or a signal.
tpuboot/wiring.py builds it; doc/architecture.md draws it.

The concurrency rule (one rule, kept everywhere):

- **The event loop** (tpuboot/eventloop.py, on the main thread) owns the daemon's state: READY,
  the device manager (every device's state, its retries and the udev monitor), and the calls to
  the notifier, the guest-attribute publisher and the metrics of the devices. Nothing on it
  blocks: no network, no file reading beyond sysfs attributes of one device, no waiting for a
  thread.
- **The worker pool** (``executor``) runs what the loop hands it: binds and /dev/vfio node fixes.
  Each future comes back to the loop by
  ``future.add_done_callback(lambda f: loop.call_soon_threadsafe(handler, f))``; the worker
  thread touches nothing else.
- **A component's own threads** do its blocking work: the runtime-environment side (tpu-env
  sync, then the watch; it also tells the containers to look at their image again), the
  containers (the GKE check, one supervisor per container), the guest-attribute publisher, the
  metrics server, the notices (a watch per key and the hook runner, tpuboot/notices/), libtpu's
  runtime metrics (a poller only while a chip is held, tpuboot/runtime/). Each
  component owns its state and guards it with its own lock (or an Event); its ``status()``
  returns an immutable :class:`~tpuboot.component.Status`, so any thread may read it.
- **Results come back by report**: a thread never touches the loop's state; it calls
  ``report()``, which is ``loop.call_soon_threadsafe(self._changed)``, and the loop then reads every
  component's ``status()`` and derives STATUS, the guest attributes and the TPU-VM gate from that
  data (metrics are derived where the state changes, from the same data).
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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tpuboot import __version__, bootbudget, metrics
from tpuboot import signals as meaning
from tpuboot.component import Component, Status
from tpuboot.containers.agents import VBAR
from tpuboot.containers.supervisor import RUNNING
from tpuboot.devices.health import read_healths, summary
from tpuboot.devices.manager import DeviceManager
from tpuboot.devices.survey import survey
from tpuboot.env.service import PENDING, EnvService
from tpuboot.eventloop import EventLoop, Timer, nothing
from tpuboot.gce.client import MetadataClient
from tpuboot.notify import Notifier, watchdog_interval

if TYPE_CHECKING:
    from tpuboot.containers.cdi_file import SpecWriter
    from tpuboot.containers.service import Containers
    from tpuboot.containers.vbar_relay import VbarRelay
    from tpuboot.devices.recovery import AutoRecovery
    from tpuboot.gce.guestattrs import Publisher
    from tpuboot.metrics_endpoint import MetricsEndpoint
    from tpuboot.notices.service import Notices
    from tpuboot.runtime.collector import RuntimeCollector

log = logging.getLogger("tpuboot.daemon")

#: The tick's pace when systemd asks for no watchdog (the tick is then only the periodic checks).
TICK_INTERVAL = 30.0


class Daemon:
    def __init__(
        self,
        loop: EventLoop,
        devices: DeviceManager,
        executor: ThreadPoolExecutor,
        notifier: Notifier,
        env: EnvService | None = None,
        containers: Containers | None = None,
        guest_attrs: Publisher | None = None,
        metadata: MetadataClient | None = None,
        metrics_endpoint: MetricsEndpoint | None = None,
        budget: bootbudget.Budget | None = None,
        cdi: SpecWriter | None = None,
        recovery: AutoRecovery | None = None,
        vbar_relay: VbarRelay | None = None,
        notices: Notices | None = None,
        runtime: RuntimeCollector | None = None,
    ) -> None:
        self.loop = loop  # the device manager's too; serve() runs it once, then closes it
        self.devices = devices
        self.executor = executor
        self.notifier = notifier
        self.env = env
        self.containers = containers  # vBar and telemetry: started at once, never waited for
        self.guest_attrs = guest_attrs  # publishes the state below; never waited for
        self.metadata = metadata  # shared by env, containers and guest_attrs; closed at the end
        self.metrics_endpoint = metrics_endpoint  # opened in its own thread: READY never waits for it
        self.budget = budget  # the boot's phases, shown at READY and when vBar first runs
        self.cdi = cdi  # the CDI spec: refreshed in the turn of every device change
        self.recovery = recovery  # recovery.automatic: wedged chips reset at each tick, in the pool
        self.vbar_relay = vbar_relay  # vBar's socket for containers: its own thread, never waited for
        self.notices = notices  # maintenance and preemption notices: its own threads, never waited for
        self.runtime = runtime  # libtpu's runtime metrics: looked for at each tick, polled in its own thread
        self.ready = False
        self.stopping = False  # STOPPING=1 sent: nothing shown changes any more
        self._stop_asked = threading.Event()  # by a signal or request_stop, from any thread
        self._tick_timer: Timer | None = None
        self._check: Future[None] | None = None  # the periodic checks handed to the pool last
        self._pcie: str | None = None  # the TPUs' PCIe state for the guest attribute; None: not read yet
        self._pcie_sent: str | None = None  # the pool's last reading sent to the loop (the pool's own)
        self._signal_log = meaning.SignalLog()
        self._debug_from: int | None = None  # the level SIGUSR2 turned debug logging on from

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
        server = None if self.metrics_endpoint is None else self.metrics_endpoint.server
        connections = "off" if server is None else str(server.connections)
        log.info(
            "SIGUSR1: threads %d, peak RSS %d KiB, metrics connections %s",
            threading.active_count(), peak, connections, extra=fields)  # fmt: skip

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

    def components(self) -> list[Component]:
        """What the daemon runs and shows the Status of, in STATUS's order."""
        parts: list[Component] = [self.devices]
        if self.env is not None:
            parts.append(self.env)
        if self.containers is not None and self.containers.enabled:
            parts.append(self.containers)
        if self.notices is not None:
            parts.append(self.notices)
        if self.runtime is not None:
            parts.append(self.runtime)
        return parts

    def statuses(self) -> list[Status]:
        return [part.status() for part in self.components()]

    def status_line(self) -> str:
        return "; ".join(s.detail for s in self.statuses() if s.detail)  # a quiet part says nothing

    def guest_attribute_values(self) -> dict[str, str]:
        """This host's state as the guest attributes tpuboot/<key> show it (tpuboot/gce/guestattrs.py)."""
        bound, present, failed = self.devices.counts()
        vbar = None if self.containers is None else self.containers.statuses().get(VBAR)
        pcie = "" if self._pcie is None else f" pcie={self._pcie}"
        return {
            "state": "ready" if self.ready else "starting",
            "tpus": f"bound={bound} expected={present} failed={failed}{pcie}",
            "tpu-env": "source=disabled" if self.env is None else self.env.attribute(),
            "vbar": "disabled" if vbar is None else vbar.detail,
            "version": __version__,
            "notice": "disabled" if self.notices is None else self.notices.attribute(),
        }

    def _changed(self) -> None:
        """On the loop, after any component's report: derive everything shown from the Statuses."""
        if self.stopping:
            return  # STATUS=stopping stays, and the guest attributes have had their last word
        self._vbar_in_budget()
        if self.containers is not None:  # vBar and the collector start only on a TPU VM
            if self.devices.counts()[1]:
                self.containers.tpu_vm_seen("a TPU is present")
            elif self.env is not None and self.env.held:
                self.containers.tpu_vm_seen("tpu-env is held")
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
        if self.ready:
            self.notifier.status(self.status_line())

    def _devices_changed(self) -> None:
        """The device manager's report: the CDI spec follows in the same turn, then the rest."""
        if self.cdi is not None:
            self.cdi.refresh()
        self._changed()

    def _vbar_in_budget(self) -> None:
        """vBar's first run ends the boot budget's last phase (after READY, which never waits for it)."""
        if self.budget is None or self.containers is None or self.budget.has(bootbudget.VBAR):
            return
        vbar = self.containers.statuses().get(VBAR)
        if vbar is not None and vbar.state == RUNNING:
            self.budget.mark(bootbudget.VBAR)
            self._publish_budget()

    def _publish_budget(self) -> None:
        """The budget as metrics, and to /run/tpuboot/boot.json from the pool (a file write)."""
        budget = self.budget
        if budget is None:
            return
        metrics.boot_phases(budget.phases())
        self.executor.submit(budget.save)

    def _booted(self) -> bool:
        """What READY waits for: the devices settled (DeviceManager.booted) and the boot-time
        tpu-env sync ended. Checked by the loop after every round, so no change is missed."""
        return self.devices.booted() and (self.env is None or self.env.status().state != PENDING)

    # ------------------------------------------------------------------ the loop

    def _tick(self, interval: float, watchdog: bool) -> None:
        """Now and every ``interval``, the loop's only periodic wake-up: WATCHDOG=1 when systemd
        asked for it, and the periodic checks. Re-armed first, so nothing the send or a check does
        can end the watchdog."""
        self._tick_timer = self.loop.call_later(interval, self._tick, interval, watchdog)
        if watchdog:
            self.notifier.watchdog()
        self._periodic_checks()

    def _pcie_round(self) -> None:
        """The TPUs' PCIe state, read once a tick (from the pool) for both of its readers: the
        guest attribute's summary first (a word; the loop shows it if it changed), then
        recovery.automatic's look for wedged chips."""
        binder = self.devices.binder
        tpus = survey(binder)
        health = read_healths(binder.root, (t.address for t in tpus))
        if self.guest_attrs is not None:
            value = summary(health.values())
            if value != self._pcie_sent:  # an unchanged reading wakes nothing
                self._pcie_sent = value
                self.loop.call_soon_threadsafe(self._pcie_read, value)
        if self.recovery is not None:
            self.recovery.check(tpus, health)

    def _pcie_read(self, value: str) -> None:
        self._pcie = value
        self._changed()

    def _has_periodic_checks(self) -> bool:
        endpoints = self.containers is not None and self.containers.checks_endpoints
        runtime = self.runtime is not None and self.runtime.missing is None
        return endpoints or runtime or self.recovery is not None or self.guest_attrs is not None

    def _periodic_checks(self) -> None:
        """The agents' endpoints probed, the wedged chips reset and the TPUs' PCIe state read for
        the guest attribute, in the pool (a connect may wait, a reset takes seconds); one round at
        a time, so a slow one is never queued behind itself. Results come back by report (or on
        the loop by call_soon_threadsafe), or through the udev events a reset causes."""
        if self.stopping or not self._has_periodic_checks():
            return
        if self._check is not None and not self._check.done():
            return
        self._check = self.executor.submit(self._periodic_work)

    def _periodic_work(self) -> None:
        """One round of the periodic checks (in the pool); a bug in one is logged, never lost in
        its future, and the other still runs."""
        checks = []
        if self.containers is not None and self.containers.checks_endpoints:
            checks.append(self.containers.check_endpoints)
        if self.recovery is not None or self.guest_attrs is not None:
            checks.append(self._pcie_round)
        if self.runtime is not None:
            checks.append(self.runtime.check)
        for check in checks:
            try:
                check()
            except Exception:
                log.exception("periodic check %s failed; please report it", check.__qualname__)

    def run(self) -> int:
        """Start every component, READY once booted, then serve until stopped (on the loop's thread)."""
        loop = self.loop

        def report() -> None:  # from any thread: the loop reads the Statuses
            loop.call_soon_threadsafe(self._changed)

        self.devices.start(self._devices_changed)  # on the loop: coldplug before any udev event binds
        if self.cdi is not None:
            self.cdi.refresh()  # the chips bound already (a restart), or none: no spec of a past run
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
            self.guest_attrs.start()  # its own thread: READY never waits for it
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.start()  # its own thread: READY never waits for it
        interval = watchdog_interval()
        if interval or self._has_periodic_checks():
            self._tick(interval or TICK_INTERVAL, watchdog=bool(interval))
        if self.env is not None:
            self.env.start(report)
        if self.notices is not None:  # its own threads: READY never waits for it
            self.notices.start(report)
        if self.runtime is not None:  # polls in its own thread, only while a chip is held
            self.runtime.start(report)
        if self.containers is not None:  # in their own threads: READY never waits for dockerd
            self.containers.start(report)
        if self.vbar_relay is not None:
            self.vbar_relay.start()  # binds its socket, then serves it in its own thread
        self._changed()  # the TPUs coldplug found open the containers' gate at once
        asked = self._stop_asked.is_set
        try:
            # SIGTERM during a long boot (metadata server down) ends this wait: no deadline to sit out.
            loop.run_until(lambda: asked() or self._booted())
            if not asked():
                line = self.status_line()
                log.info("ready: %s", line)
                self.notifier.ready(line)
                self.ready = True  # after READY=1 went out: a thread that sees it sees that too
                self._ready_budget()
                if self.guest_attrs is not None:
                    self.guest_attrs.update(self.guest_attribute_values())  # state=ready
                loop.run_until(asked)
        finally:
            self.stopping = True
            self.notifier.stopping()
            log.info("stopping")
            self._stop()
            if self._tick_timer is not None:
                self._tick_timer.cancel()
        return 0

    def _ready_budget(self) -> None:
        """READY's phase, and the whole budget in one structured journal line."""
        if self.budget is None:
            return
        self.budget.mark(bootbudget.READY)
        self._vbar_in_budget()  # running already: said in this line too
        log.info("%s", self.budget.summary(), extra=self.budget.journal_fields())
        self._publish_budget()

    def _stop(self) -> None:
        """The devices let go on the loop (their reader and timers are its own); the rest ends in a
        thread while the loop runs on (the watchdog, and the signals' meanings: a second SIGTERM
        is logged and ignored), for :data:`~tpuboot.signals.STOP_BUDGET` at most."""
        self.devices.stop()
        done = threading.Event()

        def stop_components() -> None:
            try:
                self._stop_components()
            except Exception:  # a bug: the stop still ends, and says so
                log.exception("stop: unexpected error; stopping all the same, please report it")
            finally:
                done.set()
                self.loop.call_soon_threadsafe(nothing)

        overdue = threading.Event()
        timer = self.loop.call_later(meaning.STOP_BUDGET, overdue.set)
        threading.Thread(target=stop_components, name="tpuboot-stop", daemon=True).start()
        self.loop.run_until(lambda: done.is_set() or overdue.is_set())
        timer.cancel()
        if not done.is_set():
            log.error(
                "stop: still not finished after %g s; exiting all the same (%s)",
                meaning.STOP_BUDGET, ", ".join(t.name for t in threading.enumerate()))  # fmt: skip

    def _stop_components(self) -> None:
        """Every component told to end; the last guest-attribute write before the shared metadata
        client is closed (which cuts a fetch, a long-poll or a GKE check in flight). Each wait
        here has a bound of its own; STOP_BUDGET bounds them together."""
        if self.cdi is not None:
            self.cdi.stop()
        if self.env is not None:
            self.env.stop()
        if self.notices is not None:
            self.notices.stop()
        if self.runtime is not None:
            self.runtime.stop()
        if self.guest_attrs is not None:
            self.guest_attrs.stop(final={"state": "stopped"})
        if self.metadata is not None:
            self.metadata.close()
        if self.containers is not None:
            self.containers.stop()  # containers keep running; an exec child is ended
        if self.vbar_relay is not None:
            self.vbar_relay.stop()  # its socket removed
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
