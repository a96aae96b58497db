"""The daemon's runtime-environment side: tpu-env written once before READY, then kept current.

A part of the daemon (tpuboot/component.py) with one thread of its own: the boot-time sync (within
``metadata.boot_deadline``), then, with ``metadata.watch``, the watch. Each result becomes this
part's Status (under its lock), goes to each listener (the CDI spec's refresh from boot on; the
containers from when they start, after READY: vBar's image may have changed), and is reported;
nothing here runs on the daemon's loop, so a slow server, a file read or a container's
reconfiguring never holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

from tpuboot import component, metrics
from tpuboot.component import Part, Report, Status
from tpuboot.env.published import Published, published
from tpuboot.env.results import Source, SyncResult
from tpuboot.env.sync import EnvSync
from tpuboot.env.watch import watch_tpu_env
from tpuboot.eventloop import nothing

log = logging.getLogger("tpuboot.env.service")

#: The env service's state (Status.state): pending until the boot-time sync ends, then the
#: source of the last result.
EnvState = Literal[Source, "pending"]
#: Before the boot-time sync ended: the daemon's PENDING, so READY waits while the state is this.
PENDING: Final[EnvState] = component.PENDING
#: The sources after which the tpu-env file holds values (a later failure leaves them there).
HELD: tuple[Source, ...] = ("metadata", "cache")


class EnvService(Part):
    """tpu-env from metadata (or the cache) as a part; its state is the last result's source."""

    name = "tpu-env"

    def __init__(
        self,
        sync: EnvSync,
        deadline: float,
        watch: bool,
        on_values: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sync = sync
        self.deadline = deadline
        self.watch = watch
        # Called in this part's thread after each result, in the order given; :meth:`listen` adds more.
        self._listeners: list[Callable[[], None]] = [] if on_values is None else [on_values]
        self.clock = clock
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._status = Status(PENDING, "tpu-env: pending")
        self._attribute = "source=pending"  # the guest attribute tpuboot/tpu-env
        self._held = False
        self._report: Report = nothing
        self._thread: threading.Thread | None = None

    def start(self, report: Report) -> None:
        self._report = report
        self._thread = threading.Thread(target=self._run, name="tpuboot-env", daemon=True)
        self._thread.start()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` too, in this part's thread, after each result from now on (from any
        thread: the containers, which read tpu-env's values themselves when they start, join
        after READY)."""
        with self._lock:
            self._listeners.append(listener)

    def stop(self) -> None:
        """Ends the watch at its next wake-up; closing the metadata client (the daemon does, after
        this) cuts a fetch or long-poll in flight."""
        self.stopping.set()

    def status(self) -> Status:
        with self._lock:
            return self._status

    @property
    def held(self) -> bool:
        """Whether the tpu-env file holds values tpuboot wrote (from metadata or the cache)."""
        with self._lock:
            return self._held

    def attribute(self) -> str:
        """tpuboot/tpu-env: where the file's values came from, how many, when (UTC), and what this
        worker publishes for a comparison across the slice (tpuboot/env/published.py)."""
        with self._lock:
            return self._attribute

    # ------------------------------------------------------------------ its own thread

    def _run(self) -> None:
        """Nothing here can keep the daemon from READY: this is the thread's one guard of the boot
        sync (a bug that gets past the sync's cache fallback is logged here and the status says so)
        and the watch still starts (it starts itself again after a bug: tpuboot/env/watch.py)."""
        try:
            result = self.sync.sync_once(self.deadline)
        except Exception as exc:
            log.exception("tpu-env: the boot-time sync failed unexpectedly")
            self._set(Status("failed", f"tpu-env: failed ({type(exc).__name__}); see the log"))
        else:
            self.result(result)
        if self.watch:
            watch_tpu_env(self.sync, self.stopping, self.result)

    def _published(self) -> Published | None:
        """What tpu-env as written now publishes; None if tpuboot holds no values of it."""
        values = self.sync.parsed_values()
        return None if values is None else published(values)

    def result(self, result: SyncResult) -> None:
        """Take one sync's result: the status, the guest attribute and identity metric, the
        containers told."""
        mine = self._published() if result.source in HELD else None
        with self._lock:
            if result.source in HELD:  # when written: a reader computes the age
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
                words = f" {mine.attribute()}" if mine is not None else ""
                self._attribute = f"source={result.source} keys={result.keys} updated={when}{words}"
                self._held = True
                metrics.slice_identity(None if mine is None else (mine.worker, mine.digest))
            elif result.source == "absent" or not self._held:  # a failure keeps what the file holds
                self._attribute = f"source={result.source}"
                self._held = False
                metrics.slice_identity(None)
            state: EnvState = result.source
            self._status = Status(state, result.status)
            listeners = list(self._listeners)
        for listener in listeners:  # the spec's topology, VBARCONTROL_AGENT_DOCKER_URL may have changed
            try:
                listener()
            except Exception:
                log.exception("tpu-env: acting on a change failed unexpectedly; please report it")
        self._report()

    def _set(self, status: Status) -> None:
        with self._lock:
            self._status = status
        self._report()
