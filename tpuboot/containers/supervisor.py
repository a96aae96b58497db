"""Keep one container running: start or adopt it, wait for it to end, restart it after a backoff.

The loop runs in its own thread over a :class:`Runtime` (a docker container, a child process)
and reports its :class:`~tpuboot.component.Status` through ``on_status(label, status)`` (called
from that thread; ``status()`` reads it from any other). It never polls:
it blocks in the runtime's ``wait`` (Docker's event stream, ``waitpid``) or on an event that
``reconfigure`` and ``stop`` set.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from tpuboot import metrics
from tpuboot.backoff import RestartPolicy
from tpuboot.component import Status
from tpuboot.errors import TpubootError

log = logging.getLogger("tpuboot.containers.supervisor")

#: Cap on the wait between tries to reach an absent runtime (dockerd not started yet).
UNAVAILABLE_RETRY_MAX = 10.0
#: A runtime that stayed usable this long before failing again starts its backoff afresh.
UNAVAILABLE_STABLE_AFTER = 60.0

#: A supervised container's states (Status.state); only RUNNING counts as up (tpuboot_container_up).
SupervisedState = Literal["starting", "running", "waiting", "refused", "failed", "restarting"]
STARTING: Final[SupervisedState] = "starting"
RUNNING: Final[SupervisedState] = "running"
WAITING: Final[SupervisedState] = "waiting"
REFUSED: Final[SupervisedState] = "refused"
FAILED: Final[SupervisedState] = "failed"
RESTARTING: Final[SupervisedState] = "restarting"

#: How many of the last restart delays a supervisor keeps (:attr:`Supervisor.delays`).
RECENT_DELAYS = 64


class RuntimeUnavailable(TpubootError):
    """The runtime cannot be reached now (dockerd absent or starting): wait and retry, no backoff count."""


class StartFailed(TpubootError):
    """This start failed (the container would not start): counted like an exit."""


class CannotStart(TpubootError):
    """Retrying now cannot help (the image cannot be pulled): wait for a change or ``backoff_max``."""


class Refused(TpubootError):
    """The wanted container must not run (its image's registry is not allowed): nothing was pulled
    or run, and nothing is retried until the wanted one changes (``reconfigure``) or tpuboot stops."""


@dataclass(frozen=True)
class Started:
    how: str  # started, adopted, restarted, recreated
    ident: str  # container id or pid


class Runtime(Protocol):
    #: Structured journal fields naming what runs (e.g. CONTAINER=...).
    fields: dict[str, str]

    def start(self) -> Started:
        """Make it run (or adopt it running). Raises one of the errors above."""
        ...

    def wait(self) -> str | None:
        """Block until it ends: how it ended ("exit 1"), or None when interrupted.

        Raises RuntimeUnavailable when the runtime itself went away.
        """
        ...

    def interrupt(self) -> bool:
        """If the wanted container changed (from the one running or refused), make ``wait`` return
        None soon and say True. From another thread than the loop's (it may read files)."""
        ...

    def close(self) -> None:
        """Stop supervising: a container is left running, a child process is ended."""
        ...

    def kill(self) -> None:
        """End what runs now (SIGKILL: what no longer answers is not trusted to end on SIGTERM), so
        that ``wait`` returns its exit and the loop restarts it as after any exit. From another
        thread than the loop's."""
        ...


class Supervisor:
    def __init__(
        self,
        label: str,
        runtime: Runtime,
        policy: RestartPolicy,
        on_status: Callable[[str, Status], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.runtime = runtime
        self.policy = policy
        self.on_status = on_status
        self.clock = clock
        self._status_lock = threading.Lock()
        self._status = Status(STARTING, "starting")  # replaced whole by the loop's thread
        self.starts = 0
        # The last restart delays, for the tests; bounded, as a daemon that lives for months restarts
        # its containers without end (a list of every delay grew with each vBar kill: issue 38).
        self.delays: collections.deque[float] = collections.deque(maxlen=RECENT_DELAYS)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self) -> Status:
        """The state now, from any thread."""
        with self._status_lock:
            return self._status

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"tpuboot-{self.label}", daemon=True)
        self._thread.start()

    def reconfigure(self) -> None:
        """The desired configuration may have changed (tpu-env): start again, adopting or recreating."""
        if self.runtime.interrupt():
            self._wake.set()  # also cuts a restart delay short

    def restart(self, why: str) -> None:
        """End the running container (``why``: for the journal) and let the loop restart it, counted
        and backed off as any exit. From any thread; a failure to end it is logged, not raised."""
        self._log(logging.ERROR, "%s; restarting it", why)
        try:
            self.runtime.kill()
        except Exception as exc:  # the engine went away meanwhile: its own wait says so
            self._log(logging.WARNING, "cannot end it (%s); left to the engine", exc)

    def stop(self, timeout: float = 8.0) -> None:
        self._stop.set()
        self._wake.set()
        self.runtime.close()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop (own thread)

    def _set(self, state: SupervisedState, detail: str) -> None:
        status = Status(state, detail)
        with self._status_lock:
            self._status = status
        metrics.container_up(self.label, state == RUNNING)
        self.on_status(self.label, status)

    def _sleep(self, seconds: float | None) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _log(self, level: int, message: str, *args: object) -> None:
        log.log(level, f"{self.label}: {message}", *args, extra={**self.runtime.fields, "AGENT": self.label})

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug here must show, not kill the daemon silently
            log.exception("%s: supervisor failed", self.label, extra=self.runtime.fields)
            self._set(FAILED, "supervisor failed (see the journal)")

    def _loop(self) -> None:
        # One backoff for the runtime failing, whether at start or while waiting: a dockerd that
        # answers but breaks every event stream (start adopts, wait fails at once) is retried at
        # a growing pace, not in a tight loop. It starts afresh once a wait ends normally or the
        # runtime held for UNAVAILABLE_STABLE_AFTER.
        unavailable = RestartPolicy(1.0, UNAVAILABLE_RETRY_MAX, UNAVAILABLE_STABLE_AFTER)
        last_unavailable = ""
        last_refused = ""
        while not self._stop.is_set():
            self._wake.clear()
            started_at = self.clock()
            try:
                started = self.runtime.start()
            except RuntimeUnavailable as exc:
                if unavailable.exits == 0 or str(exc) != last_unavailable:
                    self._log(logging.WARNING, "%s; waiting for it", exc)
                last_unavailable = str(exc)
                self._set(WAITING, f"waiting ({exc})")
                self._sleep(unavailable.delay_after(0.0))
                continue
            except Refused as exc:
                if str(exc) != last_refused:  # a wake-up for the same refused container says nothing new
                    self._log(logging.WARNING, "%s; not retried until the wanted image changes", exc)
                last_refused = str(exc)
                self._set(REFUSED, str(exc))
                self._sleep(None)  # until reconfigure() sees another wanted container, or stop()
                continue
            except CannotStart as exc:
                self._log(logging.ERROR, "%s", exc)
                self._set(FAILED, f"failed: {exc}")
                self._sleep(self.policy.maximum)
                continue
            except StartFailed as exc:
                self._restart_later(f"start failed: {exc}", 0.0)
                continue
            last_refused = ""
            if self._stop.is_set():
                break
            self.starts += 1
            self._log(logging.INFO, "%s %s", started.how, started.ident)
            self._set(RUNNING, "running")
            try:
                ended = self.runtime.wait()
            except RuntimeUnavailable as exc:
                delay = unavailable.delay_after(self.clock() - started_at)
                if unavailable.exits == 1 or str(exc) != last_unavailable:
                    self._log(logging.WARNING, "%s; waiting for it", exc)
                last_unavailable = str(exc)
                self._set(WAITING, f"waiting ({exc})")
                self._sleep(delay)
                continue
            unavailable.reset()
            if self._stop.is_set():
                break
            if ended is not None:
                self._restart_later(ended, self.clock() - started_at)

    def _restart_later(self, ended: str, ran_for: float) -> None:
        delay = self.policy.delay_after(ran_for)
        self.delays.append(delay)
        metrics.container_restarted(self.label)
        if self.policy.crash_loop:
            what = f"crash loop ({self.policy.exits} exits in a row, last {ended}), restarting in {delay:g} s"
            self._log(logging.ERROR, "%s", what)
        else:
            what = f"{ended}, restarting in {delay:g} s"
            self._log(logging.WARNING, "%s", what)
        self._set(RESTARTING, what)
        self._sleep(delay)
