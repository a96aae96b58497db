"""`tpuboot run`: the boot-time service. Watch first, then coldplug, then READY; sleep until told.

The loop owns no polling: it wakes for a udev event, a retry timer, the watchdog, a component's
report, or a signal. tpuboot/wiring.py builds it; doc/architecture.md draws it.

The concurrency rule (one rule, kept everywhere):

- **The asyncio loop** (the main thread) owns the daemon's state: READY, the device manager
  (every device's state, its retries and the udev monitor), and the calls to the notifier, the
  guest-attribute publisher and the metrics of the devices. Nothing on it blocks: no network, no
  file reading beyond sysfs attributes of one device, no waiting for a thread.
- **The worker pool** (``executor``) runs what the loop hands it and awaits: binds and
  /dev/vfio node fixes. Its results come back as futures the loop awaits.
- **A component's own threads** do its blocking work: the runtime-environment side (tpu-env
  sync, then the watch; it also tells the containers to look at their image again), the
  containers (the GKE check, one supervisor per container), the guest-attribute publisher, the
  metrics server. Each component owns its state and guards it with its own lock (or an Event);
  its ``status()`` returns an immutable :class:`~tpuboot.component.Status`, so any thread may read
  it.
- **Results come back by report**: a thread never touches the loop's state; it calls
  ``report()``, which is ``loop.call_soon_threadsafe(self._changed)``, and the loop then reads every
  component's ``status()`` and derives STATUS, the guest attributes and the TPU-VM gate from that
  data (metrics are derived where the state changes, from the same data).
- A flag shared between threads is a ``threading.Event`` or sits under a lock; the shared
  metadata client is thread-safe and closed once, by the daemon, after the last write.

asyncio and threads both stay: the device side is many short, overlapping waits (binds, retry
timers, udev events) that a loop keeps in one thread without locks, while the other parts block
in libraries that have no asyncio form (requests, the Docker socket's event stream, waitpid).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tpuboot import __version__
from tpuboot.component import Status
from tpuboot.containers.service import VBAR
from tpuboot.devices.manager import DeviceManager
from tpuboot.env.metadata import MetadataClient
from tpuboot.env.service import PENDING, EnvService
from tpuboot.notify import Notifier, watchdog_interval

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tpuboot.containers.service import Containers
    from tpuboot.guestattrs import Publisher

log = logging.getLogger("tpuboot.daemon")


class Daemon:
    def __init__(
        self,
        devices: DeviceManager,
        executor: ThreadPoolExecutor,
        notifier: Notifier,
        env: EnvService | None = None,
        containers: Containers | None = None,
        guest_attrs: Publisher | None = None,
        metadata: MetadataClient | None = None,
        metrics_server: WSGIServer | None = None,
    ) -> None:
        self.devices = devices
        self.executor = executor
        self.notifier = notifier
        self.env = env
        self.containers = containers  # vBar and telemetry: started at once, never waited for
        self.guest_attrs = guest_attrs  # publishes the state below; never waited for
        self.metadata = metadata  # shared by env, containers and guest_attrs; closed at the end
        self.metrics_server = metrics_server
        self.ready = False
        self.stopping = asyncio.Event()
        self._env_booted: asyncio.Future[None] | None = None

    def serve(self) -> int:
        """Run until SIGTERM; returns the process exit status."""
        return asyncio.run(self.run())

    # ------------------------------------------------------------------ derived from Status

    def statuses(self) -> list[Status]:
        parts = [self.devices.status()]
        if self.env is not None:
            parts.append(self.env.status())
        if self.containers is not None and self.containers.enabled:
            parts.append(self.containers.status())
        return parts

    def status_line(self) -> str:
        return "; ".join(s.detail for s in self.statuses())

    def guest_attribute_values(self) -> dict[str, str]:
        """This host's state as the guest attributes tpuboot/<key> show it (tpuboot/guestattrs.py)."""
        bound, present, failed = self.devices.counts()
        vbar = None if self.containers is None else self.containers.statuses().get(VBAR)
        return {
            "state": "ready" if self.ready else "starting",
            "tpus": f"bound={bound} expected={present} failed={failed}",
            "tpu-env": "source=disabled" if self.env is None else self.env.attribute(),
            "vbar": "disabled" if vbar is None else vbar.detail,
            "version": __version__,
        }

    def _changed(self) -> None:
        """On the loop, after any component's report: derive everything shown from the Statuses."""
        if self.containers is not None:  # vBar and the collector start only on a TPU VM
            if self.devices.counts()[1]:
                self.containers.tpu_vm_seen("a TPU is present")
            elif self.env is not None and self.env.held:
                self.containers.tpu_vm_seen("tpu-env is held")
        booted, env = self._env_booted, self.env
        if booted is not None and not booted.done() and (env is None or env.status().state != PENDING):
            booted.set_result(None)
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
        if self.ready:
            self.notifier.status(self.status_line())

    # ------------------------------------------------------------------ the loop

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

        def report() -> None:  # from any thread: the loop reads the Statuses
            with contextlib.suppress(RuntimeError):  # the loop has ended: nothing left to show
                loop.call_soon_threadsafe(self._changed)

        self._env_booted = loop.create_future()
        self.devices.start(self._changed)  # on the loop: coldplug before any udev event binds
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
            self.guest_attrs.start()  # its own thread: READY never waits for it
        interval = watchdog_interval()
        watchdog = loop.create_task(self._watchdog(interval)) if interval else None
        if self.env is not None:
            self.env.start(report)
        if self.containers is not None:  # in their own threads: READY never waits for dockerd
            self.containers.start(report)
        self._changed()  # the TPUs coldplug found open the containers' gate at once
        boot = asyncio.ensure_future(asyncio.gather(self.devices.settle(), self._env_booted))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            # SIGTERM during a long boot (metadata server down) must not wait for its deadline.
            either: set[asyncio.Future[Any]] = {boot, stop}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if boot.done():
                boot.result()
                self.ready = True
                line = self.status_line()
                log.info("ready: %s", line)
                self.notifier.ready(line)
                if self.guest_attrs is not None:
                    self.guest_attrs.update(self.guest_attribute_values())  # state=ready
                await stop
        finally:
            boot.cancel()
            boot.add_done_callback(_quiet)  # a boot cut short by SIGTERM is no error to log
            stop.cancel()
            self.notifier.stopping()
            log.info("stopping")
            if watchdog:
                watchdog.cancel()
            self._stop()
        return 0

    def _stop(self) -> None:
        """Every component told to end; the last guest-attribute write before the shared metadata
        client is closed (which cuts a fetch, a long-poll or a GKE check in flight)."""
        self.devices.stop()
        if self.env is not None:
            self.env.stop()
        if self.guest_attrs is not None:
            self.guest_attrs.stop(final={"state": "stopped"})
        if self.metadata is not None:
            self.metadata.close()
        if self.containers is not None:
            self.containers.stop()  # containers keep running; an exec child is ended
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
