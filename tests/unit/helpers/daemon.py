"""The daemon as `tpuboot run` builds it, over the fake kernel, serving in a thread: what the
daemon, binding-fault, CDI, metrics, supervisor, image-source and docs tests drive it with.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from harness.polling import wait_until
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import binder
from tpuboot import derived
from tpuboot.config import (
    Config,
    EnvConfig,
    GuestAttributesConfig,
    MetadataConfig,
    MetricsConfig,
    NoticesConfig,
    ReadyConfig,
    VbarConfig,
)
from tpuboot.containers.service import Containers
from tpuboot.daemon import Daemon
from tpuboot.derived import GuestAttributes
from tpuboot.env.service import EnvService
from tpuboot.eventloop import EventLoop
from tpuboot.gce.client import MetadataClient
from tpuboot.notices.service import Notices
from tpuboot.notify import Notifier
from tpuboot.paths import Root
from tpuboot.wiring import build


@dataclass
class Event:
    action: str
    subsystem: str
    sys_name: str


class QueueMonitor:
    """A pyudev-like monitor fed by the test: a socketpair makes it wake the event loop."""

    def __init__(self) -> None:
        self.rx, self.tx = socket.socketpair()
        self.rx.setblocking(False)
        self.events: collections.deque[Event] = collections.deque()

    def fileno(self) -> int:
        return self.rx.fileno()

    def push(self, action: str, subsystem: str, name: str) -> None:
        self.events.append(Event(action, subsystem, name))
        self.tx.send(b"x")

    def poll(self, timeout: float | None = None) -> Event | None:
        try:
            self.rx.recv(1)
        except BlockingIOError:
            return None
        return self.events.popleft()


class RecordingNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []
        self.enabled = True

    def _send(self, text: str) -> None:
        self.sent.append(text)


#: wait_until with the daemon tests' bound: their conditions need the daemon's threads, on a loaded machine.
until = functools.partial(wait_until, timeout=20.0)


class Serving:
    """A daemon serving in a thread of its own; only the main thread may take signals, so it
    serves without (``serve(signals=False)``) and :meth:`stop` asks it as SIGTERM would."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="daemon-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.code = self.daemon.serve(signals=False)
        except BaseException as exc:
            self.error = exc

    @property
    def ended(self) -> bool:
        return not self.thread.is_alive()

    def stop(self, timeout: float = 20.0) -> int | None:
        """Ask it to stop; its exit status once it has (a failure if it does not in ``timeout``)."""
        self.daemon.request_stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the daemon did not stop"
        if self.error is not None:
            raise self.error
        return self.code


@contextlib.contextmanager
def serving(daemon: Daemon) -> Iterator[Serving]:
    """``daemon`` serving in a thread for the block; stopped at its end whatever happened."""
    running = Serving(daemon)
    try:
        yield running
    finally:
        if not running.ended:
            daemon.request_stop()
            running.thread.join(20)


P = TypeVar("P")


def after_boot_part(daemon: Daemon, kind: type[P]) -> P:
    """The part of type ``kind`` of a serving daemon, once there: an after-boot part is made right
    after READY (tpuboot/daemon.py), a little after ``daemon.ready`` turns true."""
    until(lambda: daemon.part(kind) is not None)
    part = daemon.part(kind)
    assert part is not None
    return part


def with_after_boot(daemon: Daemon) -> Daemon:
    """``daemon`` with its after-boot parts made and in its list, none started: the whole wiring,
    for a test that looks at it without serving (serving would make them after READY)."""
    if daemon.after_boot is not None:
        daemon.parts += daemon.after_boot()
        daemon.after_boot = None
    return daemon


def guest_attribute_values(daemon: Daemon) -> dict[str, str]:
    """What the guest attributes show of ``daemon`` now (tpuboot/derived.py), published or not."""
    attributes = daemon.part(GuestAttributes)
    pcie = None if attributes is None else attributes.pcie
    shown = (daemon.part(EnvService), daemon.part(Containers), daemon.part(Notices))
    return derived.guest_attribute_values(daemon.devices, pcie, *shown)


def on_loop(daemon: Daemon, fn: Callable[[], object]) -> object:
    """``fn()`` run on the daemon's loop, which owns the device state; its result (or exception)."""
    done = threading.Event()
    out: dict[str, object] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc
        finally:
            done.set()

    daemon.loop.call_soon_threadsafe(call)
    assert done.wait(20), "the loop did not run it"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


#: READY after each coldplugged TPU's first attempt (ready.wait_for_devices: false), as most
#: scenarios here assume; the tests of the default (wait) pass ReadyConfig() themselves.
FIRST_ATTEMPT = ReadyConfig(wait_for_devices=False)


#: Only the device side: no tpu-env, no containers, no guest attributes, no metrics endpoint, no
#: notices.
DEVICES_ONLY = Config(
    env=EnvConfig(enabled=False),
    notices=NoticesConfig(enabled=False),
    vbar=VbarConfig(enabled=False),
    guest_attributes=GuestAttributesConfig(enabled="false"),
    metrics=MetricsConfig(enabled=False),
)


def make(
    kernel: FakeKernel,
    ready: ReadyConfig = FIRST_ATTEMPT,
    config: Config = DEVICES_ONLY,
    *,
    root: Root | None = None,
    b=None,
    metadata: MetadataClient | None = None,
    engine=None,
    loop: EventLoop | None = None,
) -> tuple[Daemon, QueueMonitor, RecordingNotifier]:
    """The daemon as `tpuboot run` builds it (tpuboot.wiring.build), over the fake kernel."""
    monitor, notifier = QueueMonitor(), RecordingNotifier()
    daemon = build(
        root or kernel.root, config.replace(ready=ready), binder=b or binder(kernel), monitor=monitor,
        notifier=notifier, metadata=metadata, engine=engine, loop=loop,
    )  # fmt: skip
    return daemon, monitor, notifier


def with_env(emulator, watch: bool = False, boot_deadline: float = 5.0) -> Config:
    """DEVICES_ONLY with tpu-env from ``emulator``."""
    metadata = MetadataConfig(host=emulator.host, timeout=2.0, boot_deadline=boot_deadline, watch=watch)
    return DEVICES_ONLY.replace(env=EnvConfig(), metadata=metadata)
