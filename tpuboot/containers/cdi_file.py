"""The CDI spec's file (tpuboot/containers/cdi.py says what is in it): written atomically with the
directories it mounts, refreshed by the daemon after every change to the devices or tpu-env, and
removed when the daemon stops, so no container is given a chip nobody keeps bound.

The spec is a boot part of the daemon (a job ordered after tpuboot asks for it), vBar's relay is
not (it starts after READY): so the spec's writer makes the relay's directory too, and a container
started in between finds the directory it mounts (the socket appears in it when the relay starts).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future

from tpuboot.atomicfile import write_file
from tpuboot.component import Part, Report
from tpuboot.containers.cdi import (
    RELAY_DIR,
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


def make_dir(root: Root, path: str, mode: int) -> None:
    """The directory ``path`` (under ``root``) made if missing, with ``mode``; never through a link."""
    target = root.path(path)
    target.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or not target.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    os.chmod(target, mode)


def make_logs_dir(root: Root) -> None:
    """The host's /tmp/tpu_logs: sticky and writable by all, as /tmp (a job runs as any user)."""
    make_dir(root, TPU_LOGS_DIR, 0o1777)


def make_relay_dir(root: Root) -> None:
    """vBar's relay's directory: 0755, its socket 0666 (tpuboot/containers/vbar_relay.py says why)."""
    make_dir(root, RELAY_DIR, 0o755)


def apply(root: Root, spec: Spec | None, *, relay: bool = False) -> bool:
    """Make the spec file hold ``spec`` (removed when None), with the directories it mounts (the
    logs', and with ``relay`` the vBar relay's); True if anything changed."""
    if spec is not None:
        made = [(TPU_LOGS_DIR, make_logs_dir)] + ([(RELAY_DIR, make_relay_dir)] if relay else [])
        for path, make in made:
            try:
                make(root)
            except OSError as exc:  # the spec all the same: every chip works, only that mount not
                log.error("CDI spec: %s not made (%s)", path, exc, extra={"CDI_SPEC": SPEC_PATH})
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
            spec = render(current_chips(self.binder), extras, self.binder.table)
            return apply(self.binder.root, spec, relay=extras.vbar)

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
