"""`tpuboot run`: the boot-time service. Watch first, then coldplug, then READY; sleep until told.

The loop owns no polling: it wakes for a udev event, a retry timer, the watchdog, or a signal.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tpuboot.backoff import RestartPolicy
from tpuboot.binding import DeviceAgent
from tpuboot.coldplug import Coldplug, new_executor
from tpuboot.envsync import EnvSync, SyncResult
from tpuboot.metadata import MetadataClient
from tpuboot.notify import Notifier, watchdog_interval
from tpuboot.pci import list_addresses
from tpuboot.vfio import Binder

if TYPE_CHECKING:
    from tpuboot.agents import Agents

log = logging.getLogger("tpuboot.daemon")


class UdevDevice(Protocol):
    action: str | None
    subsystem: str | None
    sys_name: str


class Monitor(Protocol):
    def fileno(self) -> int: ...
    def poll(self, timeout: float | None = None) -> Any: ...


class EnvJob:
    """The runtime-environment side: one sync before READY, then a watch thread."""

    def __init__(self, sync: EnvSync, client: MetadataClient, deadline: float, watch: bool) -> None:
        self.sync = sync
        self.client = client
        self.deadline = deadline
        self.watch = watch
        self.stop = threading.Event()
        self.status = "tpu-env: pending"


class Daemon:
    def __init__(
        self,
        binder: Binder,
        monitor: Monitor,
        notifier: Notifier | None = None,
        env: EnvJob | None = None,
        agents: Agents | None = None,
        executor: ThreadPoolExecutor | None = None,
        coldplug: Coldplug | None = None,
    ) -> None:
        self.binder = binder
        self.monitor = monitor
        self.notifier = notifier or Notifier()
        self.env = env
        self.agents = agents  # vBar and telemetry: started at once, never waited for
        self.executor = executor or new_executor()
        self.coldplug = coldplug  # binds started before this module was imported
        self.devices = DeviceAgent(binder, self.executor, self._publish)
        self.ready = False
        self.stopping = asyncio.Event()

    def status_line(self) -> str:
        parts = [self.devices.summary()]
        if self.env is not None:
            parts.append(self.env.status)
        if self.agents is not None and self.agents.status:
            parts.append(self.agents.status)
        return "; ".join(parts)

    def _env_result(self, result: SyncResult) -> None:
        assert self.env is not None
        self.env.status = result.status
        if self.agents is not None:
            try:
                self.agents.reconfigure()  # VBARCONTROL_AGENT_DOCKER_URL may have changed
            except Exception:
                log.exception("vBar: reconfiguring after a tpu-env change failed unexpectedly")
        self._publish()

    def _agent_status(self, label: str, text: str) -> None:
        assert self.agents is not None
        self.agents.set_status(label, text)
        self._publish()

    async def _env_boot(self) -> None:
        """Write tpu-env (from metadata or cache) within the boot deadline, then keep watching.

        Nothing here can keep the daemon from READY: sync_once never raises, and if it did the
        STATUS line would say so and the watch would still start.
        """
        if self.env is None:
            return
        env, loop = self.env, asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self.executor, env.sync.sync_once, env.deadline)
        except Exception as exc:
            log.exception("tpu-env: the boot-time sync failed unexpectedly")
            env.status = f"tpu-env: failed ({type(exc).__name__}); see the log"
        else:
            self._env_result(result)
        if env.watch:
            report = functools.partial(loop.call_soon_threadsafe, self._env_result)
            threading.Thread(
                target=run_watch, args=(env.sync, env.stop, report), name="tpuboot-env-watch", daemon=True
            ).start()

    def _publish(self) -> None:
        if self.ready:
            self.notifier.status(self.status_line())

    def _on_udev(self) -> None:
        while (device := self.monitor.poll(timeout=0)) is not None:
            self._dispatch(device)

    def _dispatch(self, device: UdevDevice) -> None:
        if device.subsystem == "vfio":
            if device.action == "add" and device.sys_name.isdigit():
                self.devices.node_appeared(device.sys_name)
        elif device.action == "add":
            self.devices.consider(device.sys_name)
        elif device.action == "remove":
            self.devices.removed(device.sys_name)

    def _start_coldplug(self) -> list[asyncio.Task[None]]:
        """Bind every matching device already present (adopting binds already running); the
        monitor was started before the enumeration, so no device falls between the two."""
        early = self.coldplug or Coldplug(list_addresses(self.binder.root), {}, 0.0)
        tasks = (self.devices.consider(a, early.binds.get(a), early.started) for a in early.addresses)
        return [t for t in tasks if t is not None]

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        coldplug = self._start_coldplug()  # before any udev event can start a bind of its own
        loop.add_reader(self.monitor.fileno(), self._on_udev)
        interval = watchdog_interval()
        watchdog = loop.create_task(self._watchdog(interval)) if interval else None
        if self.agents is not None:  # in their own threads: READY never waits for dockerd
            self.agents.start(functools.partial(loop.call_soon_threadsafe, self._agent_status))
        boot = asyncio.ensure_future(asyncio.gather(*coldplug, self._env_boot()))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            # SIGTERM during a long boot (metadata server down) must not wait for its deadline.
            await asyncio.wait({boot, stop}, return_when=asyncio.FIRST_COMPLETED)
            if boot.done():
                boot.result()
                self.ready = True
                line = self.status_line()
                log.info("ready: %s", line)
                self.notifier.ready(line)
                await stop
        finally:
            boot.cancel()
            stop.cancel()
            self.notifier.stopping()
            log.info("stopping")
            loop.remove_reader(self.monitor.fileno())
            if watchdog:
                watchdog.cancel()
            self.binder.stop.set()
            if self.env is not None:
                self.env.stop.set()
                self.env.client.close()  # cuts short a boot-time fetch in flight
            if self.agents is not None:
                self.agents.stop()  # containers keep running; an exec child is ended
            self.devices.shutdown()
            self.executor.shutdown(wait=False, cancel_futures=True)
        return 0


WATCH_RESTART_MAX = 300.0


def run_watch(sync: EnvSync, stop: threading.Event, report: Callable[[SyncResult], None]) -> None:
    """The watch thread's body: EnvSync.watch never raises, and should a bug make it, the watch is
    started again (after 1 s, doubling to 5 min) instead of ending for good."""
    backoff = RestartPolicy(1.0, WATCH_RESTART_MAX, stable_after=math.inf)
    while not stop.is_set():
        try:
            sync.watch(stop, report)
            return
        except Exception:
            delay = backoff.delay_after(0.0)
            log.exception("tpu-env: the watch ended unexpectedly; starting it again in %g s", delay)
        if stop.wait(delay):
            return


def run(
    binder: Binder,
    monitor: Monitor,
    executor: ThreadPoolExecutor,
    coldplug: Coldplug,
    env: EnvJob | None = None,
    agents: Agents | None = None,
) -> int:
    """Run the daemon until SIGTERM; returns the process exit status."""
    daemon = Daemon(binder, monitor, env=env, agents=agents, executor=executor, coldplug=coldplug)
    return asyncio.run(daemon.run())
