"""The daemon's notice part: the three keys watched, each notice told (journal, STATUS, metrics,
guest attribute, /run/tpuboot/notice) and the hooks run for it.

A part of the daemon (tpuboot/component.py) with threads of its own: one watch per key
(tpuboot/notices/watch.py) and one hook runner, so neither a long-poll nor a hook that hangs ever
holds the daemon's loop, its watchdog or the next notice. READY never waits for it: its state is
never pending. Its tick paces the reads of a key the server lacks (:class:`TickPace`).

- **A new notice while hooks run** is queued, one per kind (a newer value of a kind replaces the
  queued one), and the next run takes the most urgent kind first (preempted, maintenance,
  upcoming): the run in progress is not cut, since its hooks (a checkpoint) serve the newer notice
  too, and cutting one half-way would waste what it did.
- **A value flapping** costs little: the client's watch yields a change at most once a second; a
  notice of a kind whose value and window already ran the hooks in the last :data:`REPEAT_AFTER`
  seconds does not run them again; the journal line of a kind is written at most once per
  :data:`LOG_QUIET` seconds (the next says how many changes it did not log); the file is rewritten
  only when its content changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal

from tpuboot import metrics
from tpuboot.atomicfile import FileError, remove_file
from tpuboot.component import Devices, Part, Report, Status
from tpuboot.eventloop import nothing
from tpuboot.gce.client import MetadataClient
from tpuboot.notices import noticefile
from tpuboot.notices.hooks import HOOKS_DIR, ROOT, Cancel, HookUser, find_hooks, run_hooks
from tpuboot.notices.parse import KEYS, UTC, Notice, NoticeKind, idle, parse, status_detail
from tpuboot.notices.watch import ABSENT_INTERVAL, TickPace, watch_key
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.notices")

#: The notice part's state (Status.state): no notice active, or one at least.
NoticeState = Literal["quiet", "notice"]
QUIET: Final[NoticeState] = "quiet"
NOTICE: Final[NoticeState] = "notice"
#: Seconds within which the same notice (kind, value, window) does not run the hooks again.
REPEAT_AFTER = 600.0
#: Seconds between two journal lines of one kind's changes.
LOG_QUIET = 60.0
#: The kinds by urgency: the order of STATUS's words and of queued hook runs.
URGENCY: tuple[NoticeKind, ...] = tuple(KEYS)


@dataclass(frozen=True)
class NoticeSettings:
    """The config's ``notices`` section as the part uses it."""

    hooks_dir: str = HOOKS_DIR
    hook_deadline: float = 25.0
    user: HookUser = ROOT
    hooks: bool = True  # False: the configured hook user does not exist, so no hook runs


class Notices(Part):
    """Maintenance and preemption notices as a part of the daemon; its state is ``quiet`` or ``notice``."""

    name = "notices"
    periodic = True

    def __init__(
        self,
        root: Root,
        client: MetadataClient,
        settings: NoticeSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        timeout_sec: int = 60,
        absent_interval: float = ABSENT_INTERVAL,
        hook_started: Callable[[str], None] | None = None,
    ) -> None:
        self.root = root
        self.client = client
        self.settings = settings
        self.clock = clock
        self.timeout_sec = timeout_sec
        self.absent_interval = absent_interval
        self.hook_started = hook_started  # the bench: each hook's name as it starts
        self.stopping = threading.Event()
        self.pace = TickPace(self.stopping, clock)
        self._lock = threading.Lock()  # the notices, the status, the queue and the log gate
        self._queued = threading.Condition(self._lock)
        self._notices: dict[NoticeKind, Notice] = {kind: idle(kind) for kind in URGENCY}
        self._status = Status(QUIET, "")
        self._queue: dict[NoticeKind, Notice] = {}
        self._ran: dict[NoticeKind, tuple[Notice, float]] = {}
        self._read: set[NoticeKind] = set()  # the keys whose value has been read once
        self._logged_at: dict[NoticeKind, float] = {}
        self._unlogged: dict[NoticeKind, int] = {}
        self._write_lock = threading.Lock()  # one writer of the file at a time, the latest content last
        self._report: Report = nothing
        self._threads: list[threading.Thread] = []
        self._cancel = Cancel()  # the daemon's stop kills a hook still running

    # ------------------------------------------------------------------ the part

    def start(self, report: Report) -> None:
        self._report = report
        for kind in URGENCY:
            metrics.notice(kind, False)
        for kind in URGENCY:
            self._thread(f"tpuboot-notice-{kind}", watch_key, self.client, kind, self.stopping, self.seen,
                         timeout_sec=self.timeout_sec, absent_interval=self.absent_interval,
                         pace=self.pace)  # fmt: skip
        self._thread("tpuboot-notice-hooks", self._run_hooks)

    def dump(self) -> str | None:
        """SIGUSR1's words: the keys the server lacks now, each read again at a tick."""
        parked = self.pace.parked
        return f"notice keys absent (read at the tick) {parked}" if parked else None

    def tick(self, devices: Devices) -> None:
        """The absent keys' watches read again (the tick's one wake-up of the daemon serves them)."""
        self.pace.tick()

    def stop(self) -> None:
        """Ends the watches at their next wake-up (closing the client, which the daemon does after
        this, cuts a long-poll in flight) and the hook runner after its run; removes the file, so
        nobody reads a notice state nobody keeps current."""
        with self._queued:
            self.stopping.set()
            self._queued.notify_all()
        self.pace.release()
        self._cancel.cancel()
        with self._write_lock:
            try:
                remove_file(self.root, noticefile.NOTICE_PATH)
            except FileError as exc:
                log.warning("notices: %s", exc)

    def status(self) -> Status:
        with self._lock:
            return self._status

    def attribute(self) -> str:
        """The guest attribute tpuboot/notice: ``none``, or each active notice as ``kind=value``."""
        with self._lock:
            active = [n for n in self._notices.values() if n.active]
        words = [f"{n.kind}={n.value.replace(' ', '_')}" + (f"@{n.window_text()}" if n.window_start else "")
                 for n in active]  # fmt: skip
        return " ".join(words) or "none"

    def _thread(self, name: str, target: Callable[..., None], *args: object, **kwargs: object) -> None:
        thread = threading.Thread(target=target, args=args, kwargs=kwargs, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # ------------------------------------------------------------------ a watch's thread

    def seen(self, kind: NoticeKind, body: bytes | None) -> None:
        """A key's new value (from its watch): recorded, told and, if it warns, queued for the hooks."""
        notice, odd = parse(kind, body, datetime.now(UTC))
        now = self.clock()
        with self._lock:
            before = self._notices[kind]
            if notice == before and odd is None and kind in self._read:
                return
            self._read.add(kind)  # the first value of each key is written to the file, even idle
            self._notices[kind] = notice
            worth = odd is not None or notice.active or before.active
            unlogged = self._log_due(kind, now) if worth else None
            due = notice.active and self._hooks_due(notice, now)
        if unlogged is not None:
            self._log(notice, before, odd, unlogged)
        metrics.notice(kind, notice.active, notice.window_start.timestamp() if notice.window_start else None)
        self._save()  # before the hooks run: a hook that asks the file (wait-maintenance) sees it
        with self._lock:  # and before STATUS says it: what is shown never runs ahead of the file
            detail = status_detail([self._notices[k] for k in URGENCY])
            self._status = Status(NOTICE if detail else QUIET, detail)
        if due:
            with self._queued:
                self._queue[kind] = notice
                self._queued.notify_all()
        self._report()

    def _log_due(self, kind: NoticeKind, now: float) -> int | None:
        """How many changes of ``kind`` went unlogged if a line is due now, else None (counted)."""
        last = self._logged_at.get(kind)
        if last is not None and now - last < LOG_QUIET:
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            return None
        self._logged_at[kind] = now
        return self._unlogged.pop(kind, 0)

    def _hooks_due(self, notice: Notice, now: float) -> bool:
        ran = self._ran.get(notice.kind)
        if ran is not None and ran[0] == notice and now - ran[1] < REPEAT_AFTER:
            return False
        self._ran[notice.kind] = (notice, now)
        return True

    def _log(self, notice: Notice, before: Notice, odd: str | None, unlogged: int) -> None:
        fields = {
            "NOTICE_KIND": notice.kind,
            "NOTICE_VALUE": notice.value,
            "NOTICE_ACTIVE": "1" if notice.active else "0",
            "NOTICE_WINDOW_START": notice.window_text(),
        }
        more = f" ({unlogged} changes not logged since the last line)" if unlogged else ""
        if odd is not None:
            log.warning("notice: %s%s", odd, more, extra=fields)
        if notice.active:
            at = f", window starts {notice.window_text()}" if notice.window_start else ""
            log.warning(
                "notice: %s %s%s%s", notice.kind, notice.value, at, more if odd is None else "", extra=fields
            )
        elif before.active:
            log.info(
                "notice: %s cleared (%s)%s",
                notice.kind,
                notice.value,
                more if odd is None else "",
                extra=fields,
            )

    def _save(self) -> None:
        with self._write_lock:
            if self.stopping.is_set():
                return
            with self._lock:
                ordered = [self._notices[k] for k in URGENCY]
            try:
                noticefile.save(self.root, ordered)
            except FileError as exc:
                log.warning("notices: %s", exc)

    # ------------------------------------------------------------------ the hook runner's thread

    def _run_hooks(self) -> None:
        """Run the hooks for each queued notice, the most urgent first, until stopped. A bug is
        logged and the runner goes on with the next notice."""
        while True:
            with self._queued:
                while not self._queue and not self.stopping.is_set():
                    self._queued.wait()
                if self.stopping.is_set():
                    return
                kind = next(k for k in URGENCY if k in self._queue)
                notice = self._queue.pop(kind)
            if not self.settings.hooks:
                continue
            try:
                hooks = find_hooks(self.root, self.settings.hooks_dir)
                if hooks:
                    run_hooks(hooks, notice, self.settings.hook_deadline, self.settings.user,
                              started=self.hook_started, cancel=self._cancel)  # fmt: skip
            except Exception:
                log.exception("notice hooks: running them failed unexpectedly; please report it")
