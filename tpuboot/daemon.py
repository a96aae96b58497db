"""`tpuboot run`: the boot-time service. Watch first, then coldplug, then READY; sleep until told.

The loop owns no polling: it wakes for a udev event, a retry timer, the watchdog, or a signal.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tpuboot import __version__
from tpuboot.backoff import RestartPolicy
from tpuboot.config import ReadyConfig
from tpuboot.devices.manager import DeviceAgent
from tpuboot.devices.pci import list_addresses
from tpuboot.devices.udev import Coldplug, new_executor
from tpuboot.devices.vfio import Binder
from tpuboot.env.metadata import MetadataClient
from tpuboot.env.sync import EnvSync, SyncResult
from tpuboot.notify import Notifier, watchdog_interval

if TYPE_CHECKING:
    from tpuboot.containers.service import Agents
    from tpuboot.guestattrs import Publisher

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
        self.published = "source=pending"  # the guest attribute tpuboot/tpu-env


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
        ready: ReadyConfig | None = None,
        guest_attrs: Publisher | None = None,
    ) -> None:
        self.binder = binder
        self.monitor = monitor
        self.notifier = notifier or Notifier()
        self.env = env
        self.agents = agents  # vBar and telemetry: started at once, never waited for
        self.executor = executor or new_executor()
        self.coldplug = coldplug  # binds started before this module was imported
        self.ready_config = ready or ReadyConfig()
        self.guest_attrs = guest_attrs  # publishes the state below; never waited for
        self.devices = DeviceAgent(binder, self.executor, self._publish)
        self.ready = False
        self.stopping = asyncio.Event()
        self._settled: asyncio.Future[None] | None = None
        self._waited_for: list[str] = []  # the devices READY waits for (ready.wait_for_devices)

    def status_line(self) -> str:
        parts = [self.devices.summary()]
        if self.env is not None:
            parts.append(self.env.status)
        if self.agents is not None and self.agents.status:
            parts.append(self.agents.status)
        return "; ".join(parts)

    def guest_attribute_values(self) -> dict[str, str]:
        """This host's state as the guest attributes tpuboot/<key> show it (tpuboot/guestattrs.py)."""
        bound, present, failed = self.devices.counts()
        vbar = "disabled"
        if self.agents is not None and "vBar" in self.agents.statuses:
            vbar = self.agents.statuses["vBar"].removeprefix("vBar: ")
        return {
            "state": "ready" if self.ready else "starting",
            "tpus": f"bound={bound} expected={present} failed={failed}",
            "tpu-env": "source=disabled" if self.env is None else self.env.published,
            "vbar": vbar,
            "version": __version__,
        }

    def _env_result(self, result: SyncResult) -> None:
        assert self.env is not None
        self.env.status = result.status
        held = self.env.published.startswith(("source=metadata", "source=cache"))  # a file written
        if result.source in ("metadata", "cache"):  # when written: a reader computes the age
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.env.published = f"source={result.source} keys={result.keys} updated={when}"
        elif result.source == "absent" or not held:  # a failure keeps what the file still holds
            self.env.published = f"source={result.source}"
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

            def report(result: SyncResult) -> None:  # from the watch thread, onto the loop
                loop.call_soon_threadsafe(self._env_result, result)

            threading.Thread(
                target=run_watch, args=(env.sync, env.stop, report), name="tpuboot-env-watch", daemon=True
            ).start()

    def _note_tpu_vm(self) -> None:
        """vBar and the collector start only on a TPU VM: a TPU present, or tpu-env held."""
        if self.agents is None:
            return
        if self.devices.counts()[1]:
            self.agents.tpu_vm_seen("a TPU is present")
        elif self.env is not None and self.env.published.startswith(("source=metadata", "source=cache")):
            self.agents.tpu_vm_seen("tpu-env is held")

    def _publish(self) -> None:
        self._note_tpu_vm()
        if self._settled is not None and not self._settled.done() and self.devices.settled(self._waited_for):
            self._settled.set_result(None)
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
        if self.ready:
            self.notifier.status(self.status_line())

    async def _devices_settled(self) -> None:
        """With ready.wait_for_devices: until every TPU present at start is bound or has failed for
        good (retries spent, or a permanent error), at the latest after ready.device_deadline."""
        if not self.ready_config.wait_for_devices or self.devices.settled(self._waited_for):
            return
        self._settled = asyncio.get_running_loop().create_future()
        deadline = self.ready_config.device_deadline
        done, _ = await asyncio.wait({self._settled}, timeout=deadline)
        if not done:
            bound, present, _ = self.devices.counts()
            log.warning(
                "ready: %d of %d TPUs bound after %g s (ready.device_deadline); READY now, retries go on",
                bound, present, deadline)  # fmt: skip

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
        self._waited_for = list(self.devices.devices)  # the TPUs present at start (and unreadable ids)
        if self.guest_attrs is not None:
            self.guest_attrs.update(self.guest_attribute_values())
            self.guest_attrs.start()  # its own thread: READY never waits for it
        loop.add_reader(self.monitor.fileno(), self._on_udev)
        interval = watchdog_interval()
        watchdog = loop.create_task(self._watchdog(interval)) if interval else None
        if self.agents is not None:  # in their own threads: READY never waits for dockerd

            def agent_status(label: str, text: str) -> None:  # from a supervisor thread
                loop.call_soon_threadsafe(self._agent_status, label, text)

            self._note_tpu_vm()  # the TPUs coldplug found; tpu-env, when it comes, in _publish
            self.agents.start(agent_status)
        boot = asyncio.ensure_future(asyncio.gather(*coldplug, self._env_boot(), self._devices_settled()))
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
            if self.guest_attrs is not None:
                self.guest_attrs.stop(final={"state": "stopped"})
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
    ready: ReadyConfig | None = None,
    guest_attrs: Publisher | None = None,
) -> int:
    """Run the daemon until SIGTERM; returns the process exit status."""
    daemon = Daemon(
        binder, monitor, env=env, agents=agents, executor=executor, coldplug=coldplug,
        ready=ready, guest_attrs=guest_attrs,
    )  # fmt: skip
    return asyncio.run(daemon.run())
