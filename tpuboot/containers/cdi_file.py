"""The CDI spec's file (tpuboot/containers/cdi.py says what is in it): written atomically with the
directory it mounts, refreshed by the daemon after every change to the devices or tpu-env, and
removed when the daemon stops, so no container is given a chip nobody keeps bound."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future

from tpuboot.atomicfile import write_file
from tpuboot.component import Part, Report
from tpuboot.containers.cdi import (
    SPEC_PATH,
    TPU_LOGS_DIR,
    Extras,
    Spec,
    current_chips,
    log_dropped,
    render,
    to_json,
)
from tpuboot.devices.vfio import Binder
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.containers.cdi")


def make_logs_dir(root: Root) -> None:
    """The host's /tmp/tpu_logs: sticky and writable by all, as /tmp (a job runs as any user)."""
    path = root.path(TPU_LOGS_DIR)
    path.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or not path.is_dir():
        raise NotADirectoryError(f"{TPU_LOGS_DIR} is not a directory")
    os.chmod(path, 0o1777)


def apply(root: Root, spec: Spec | None) -> bool:
    """Make the spec file hold ``spec`` (removed when None), with the directory it mounts; True if
    anything changed."""
    if spec is not None:
        try:
            make_logs_dir(root)
        except OSError as exc:  # the spec all the same: every chip but the logs' mount works
            log.error("CDI spec: %s not made (%s)", TPU_LOGS_DIR, exc, extra={"CDI_SPEC": SPEC_PATH})
        return write_file(root, SPEC_PATH, to_json(spec), mode=0o644)
    try:
        os.unlink(root.path(SPEC_PATH))
    except FileNotFoundError:
        return False
    return True


class SpecWriter(Part):
    """The daemon's copy of the spec, refreshed after every change to the devices (a part of the
    daemon: :meth:`start` writes the first, :meth:`stop` removes it).

    :meth:`refresh` runs on the event loop and only hands the work to the worker pool (a read of
    sysfs and a file write: daemon.py's rule keeps both off the loop, as it keeps a bind's chmod);
    the device manager asks for one in the turn of each change, and the tpu-env service after each
    result (tpuboot/wiring.py ties both; ``extras`` gives tpu-env's values as the last sync parsed
    them, read in the pool). At most one refresh runs at a time, and one asked for meanwhile runs
    after it, so the last write always follows the last change. :meth:`stop` removes the file, and
    no write lands after it (the lock).
    """

    name = "CDI spec"

    def __init__(
        self,
        binder: Binder,
        executor: Executor,
        call_soon_threadsafe: Callable[..., object],
        extras: Callable[[], Extras] = Extras,
    ) -> None:
        self.binder = binder
        self._extras = extras
        self._dropped: Mapping[str, str] = {}  # the values left out last time, said once
        self.executor = executor
        self._back = call_soon_threadsafe
        self._running = False
        self._again = False
        self._lock = threading.Lock()  # held by a write in the pool and by stop()
        self._stopped = False

    def start(self, report: Report) -> None:
        """The chips bound already (a restart), or none: no spec of a past run is left standing."""
        self.refresh()

    @property
    def writing(self) -> bool:
        """A refresh is running or asked for (the boot's last lands a little after READY)."""
        return self._running or self._again

    def refresh(self) -> None:
        """On the loop, within the turn of a device change."""
        if self._running:
            self._again = True
            return
        self._submit()

    def _submit(self) -> None:
        self._running, self._again = True, False
        try:
            future = self.executor.submit(self._write)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            self._running = False
            return
        future.add_done_callback(lambda f: self._back(self._done, f))

    def _write(self) -> bool:
        """In the pool: the spec of the chips present now, written (or removed: no chip)."""
        with self._lock:
            if self._stopped:
                return False
            extras = self._extras()
            if extras.dropped != self._dropped:
                self._dropped = extras.dropped
                log_dropped(extras.dropped)
            return apply(self.binder.root, render(current_chips(self.binder), extras, self.binder.table))

    def _done(self, future: Future[bool]) -> None:
        """Back on the loop."""
        self._running = False
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            log.error("CDI spec %s: %s", SPEC_PATH, exc, extra={"CDI_SPEC": SPEC_PATH})
        if self._again:
            self._submit()

    def stop(self) -> None:
        """At the daemon's stop: the spec goes, so no container is given a chip nobody keeps bound."""
        with self._lock:
            self._stopped = True
            try:
                apply(self.binder.root, None)
            except OSError as exc:
                log.warning("CDI spec %s not removed: %s", SPEC_PATH, exc, extra={"CDI_SPEC": SPEC_PATH})
