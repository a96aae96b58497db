"""This host's state in the instance's guest attributes (``tpuboot/<key>``), for slice-wide views.

A slice is many VMs; ``gcloud compute instances get-guest-attributes --query-path=tpuboot/`` (or
the TPU API's getGuestAttributes, one call for every worker) shows each host's state without
logging in. Why each choice:

- Only when the instance has guest attributes on: ``enable-guest-attributes`` on the instance,
  else on the project (the instance's value wins, as in the OS Config agent), read as Go's
  ``strconv.ParseBool`` reads it (``TRUE``, ``true``, ``1``, ...; anything else is off). GCE's
  default is off, and the server then answers every guest-attributes request 403 "Guest attributes
  endpoint access is disabled."; such an answer turns publishing off until tpuboot restarts.
- The server allows at most 10 guest-attribute queries a minute per VM and bursts of 3 a second,
  and may drop writes beyond that. So each key is written at most once per ``min_interval``
  (at least 36 s: the 6 keys, ``GUEST_ATTRIBUTE_KEYS`` in tpuboot/config.py, then stay within
  10 a minute), a change arriving sooner is coalesced into
  the next write (only the latest value is sent), writes are 0.5 s apart, and a key whose value
  has not changed is not written again.
- Never blocking: ``update`` only records the values; one thread of its own does the HTTP, with
  the metadata client's deadlines. READY and binding never wait for it.
- Bounded retries: a failed write is tried again ``min_interval`` later, at most ``RETRIES``
  times for one value; then that value is given up until the key changes. Each kind of failure
  is logged once, and the recovery once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from tpuboot.component import Report, Status
from tpuboot.errors import MetadataError
from tpuboot.eventloop import nothing
from tpuboot.gce.client import MetadataClient
from tpuboot.gce.keys import GUEST_ATTRIBUTES, INSTANCE_ATTRIBUTES, PROJECT_ATTRIBUTES
from tpuboot.gce.replies import MetadataAbsent, MetadataRefused

log = logging.getLogger("tpuboot.gce.guestattrs")

NAMESPACE = "tpuboot"
#: The publisher's state (Status.state): asking whether guest attributes are on, publishing, off.
PublisherState = Literal["checking", "publishing", "off"]
CHECKING: Final[PublisherState] = "checking"
PUBLISHING: Final[PublisherState] = "publishing"
OFF: Final[PublisherState] = "off"
ENABLE_KEY = "enable-guest-attributes"
#: Seconds between any two writes: under the server's burst limit of 3 a second.
SPACING = 0.5
#: Tries of one value of one key before it is given up until the key changes.
RETRIES = 5
#: The longest value written (the server's limits are far above; a status line is not).
MAX_VALUE = 512
#: The last write at stop: short, since systemd's TimeoutStopSec=10 covers the whole stop.
FINAL_DEADLINE = 2.0

_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


@dataclass(frozen=True)
class PublisherSettings:
    """The config's ``guest_attributes`` section as plain values: ``enabled`` None to follow
    enable-guest-attributes (``auto``), and the least seconds between two writes of one key."""

    enabled: bool | None = None
    min_interval: float = 60.0


def parse_enabled(text: str) -> bool:
    """``enable-guest-attributes`` as Go's strconv.ParseBool reads it; a value it refuses is off."""
    return text in _TRUE


def enabled_in_metadata(client: MetadataClient, deadline_s: float) -> tuple[bool, str]:
    """Whether the instance has guest attributes on, and where that was read (for the log).

    Raises MetadataError when the server does not answer within ``deadline_s``.
    """
    for scope, path in (("instance", INSTANCE_ATTRIBUTES), ("project", PROJECT_ATTRIBUTES)):
        try:
            value = client.get(path + ENABLE_KEY, deadline_s=deadline_s).text.strip()
        except MetadataAbsent:
            continue
        return parse_enabled(value), f"{ENABLE_KEY}={value[:20]!r} on the {scope}"
    return False, f"{ENABLE_KEY} is set on neither the instance nor the project"


class Publisher:
    """Writes ``tpuboot/<key>`` guest attributes from its own thread; ``update`` from any thread.

    Its state is ``checking`` (asking the server whether guest attributes are on), ``publishing``
    or ``off``. The daemon's part that feeds it the values (tpuboot/derived.py) starts and stops it.
    """

    def __init__(
        self,
        client: MetadataClient,
        settings: PublisherSettings,
        *,
        check_deadline: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.settings = settings
        self.check_deadline = check_deadline
        self.clock = clock
        self.enabled: bool | None = settings.enabled
        self._report: Report = nothing
        self._cond = threading.Condition()
        self._wanted: dict[str, str] = {}
        self._sent: dict[str, str] = {}
        self._last_try: dict[str, float] = {}
        self._tries: dict[str, int] = {}  # failed tries of the value wanted now
        self._given_up: dict[str, str] = {}  # the value each given-up key holds
        self._last_write = -SPACING
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- any thread

    def update(self, values: Mapping[str, str]) -> None:
        """Record the state to publish; returns at once (a lock, no I/O)."""
        with self._cond:
            for key, value in values.items():
                value = value[:MAX_VALUE]
                if self._wanted.get(key) != value:
                    self._wanted[key] = value
                    self._tries.pop(key, None)
                    self._given_up.pop(key, None)
            self._cond.notify()

    def status(self) -> Status:
        with self._cond:
            enabled = self.enabled
        if enabled is None:
            return Status(CHECKING, f"guest attributes: asking whether {ENABLE_KEY} is on")
        if enabled:
            return Status(PUBLISHING, f"guest attributes: publishing under {NAMESPACE}/")
        return Status(OFF, "guest attributes: not published")

    def start(self, report: Report = nothing) -> None:
        """Begin publishing from a thread of its own; ``report`` is told when ``status()`` changes."""
        self._report = report
        if self.enabled is False:  # before the thread: no other reader yet
            return
        self._thread = threading.Thread(target=self._run, name="tpuboot-guest-attributes", daemon=True)
        self._thread.start()

    def stop(self, final: Mapping[str, str] | None = None) -> None:
        """End the thread; then, if publishing, the last word, once, within :data:`FINAL_DEADLINE`:
        ``final`` (like state=stopped) first, then every value updated but not yet written (the
        pacing held it back), so what the server keeps is the state at the end.

        The client is its owner's to close (the daemon shares it), after this: that also cuts a
        check of enable-guest-attributes in flight, which is why stop does not wait for one.
        """
        with self._cond:
            self._stop.set()
            self._cond.notify()
            enabled = self.enabled  # written by this publisher's thread, under the same lock
        thread = self._thread
        if thread is None or not enabled:
            return
        thread.join(timeout=FINAL_DEADLINE)
        if thread.is_alive():
            return
        ends = time.monotonic() + FINAL_DEADLINE
        with self._cond:
            last = dict(final or {})
            last.update((k, v) for k, v in self._wanted.items() if k not in last and self._sent.get(k) != v)
        for key, value in last.items():
            left = ends - time.monotonic()
            if left <= 0 or self._write(key, value, left) is not None:
                return  # the server is slow or refuses: the rest would fare no better

    # ---------------------------------------------------------------- its own thread

    def _run(self) -> None:
        try:
            if self.enabled is None and not self._check():
                return
            while not self._stop.is_set():
                due = self._next()
                if due is None:
                    continue
                key, value = due
                self._publish(key, value)
        except Exception:  # a bug here must not end more than this feature
            log.exception("guest attributes: publishing ended unexpectedly; please report it")

    def _check(self) -> bool:
        """Read enable-guest-attributes, retrying while the server does not answer."""
        while not self._stop.is_set():
            try:
                enabled, why = enabled_in_metadata(self.client, self.check_deadline)
            except MetadataError as exc:
                again = f"asking again in {self.settings.min_interval:g} s"
                self._once("check", f"guest attributes: cannot tell whether they are on ({exc}); {again}")
                if self._stop.wait(self.settings.min_interval):
                    return False
                continue
            with self._cond:
                self.enabled = enabled
            self._report()
            if enabled:
                log.info("guest attributes: publishing this host's state under %s/ (%s)", NAMESPACE, why)
            else:
                log.info(
                    "guest attributes: not published (%s); set it to TRUE and restart tpuboot to publish",
                    why,
                )
            return enabled
        return False

    def _next(self) -> tuple[str, str] | None:
        """The next key to write and its value, once due; None after a wait (or at stop)."""
        with self._cond:
            now = self.clock()
            soonest: float | None = None
            for key, value in self._wanted.items():
                if self._sent.get(key) == value or self._given_up.get(key) == value:
                    continue
                at = self._last_try.get(key, -float("inf")) + self.settings.min_interval
                at = max(at, self._last_write + SPACING)
                if at <= now:
                    self._last_try[key] = self._last_write = now
                    return key, value
                soonest = at if soonest is None else min(soonest, at)
            self._cond.wait(None if soonest is None else soonest - now)
            return None

    def _publish(self, key: str, value: str) -> None:
        error = self._write(key, value, self.client.timeout)
        with self._cond:
            if error is None:
                self._sent[key] = value
                self._tries.pop(key, None)
                return
            if isinstance(error, MetadataRefused) and error.status == 403:
                self.enabled = False
                self._stop.set()
                log.warning(
                    "guest attributes: the metadata server refuses them (%s); not publishing until "
                    "tpuboot restarts; set %s=TRUE on the instance, or guest_attributes.enabled: false",
                    error,
                    ENABLE_KEY,
                )
                self._report()  # the condition's lock is re-entrant: status() may be read at once
                return
            tries = self._tries[key] = self._tries.get(key, 0) + 1
            if tries >= RETRIES:
                self._given_up[key] = value
        if tries >= RETRIES:
            log.warning(
                "guest attributes: %s/%s not written after %d tries (%s); trying again when it changes",
                NAMESPACE, key, tries, error)  # fmt: skip
        else:
            kind = type(error).__name__ + (f" {error.status}" if isinstance(error, MetadataRefused) else "")
            again = f"trying again in {self.settings.min_interval:g} s (logged once until a write succeeds)"
            self._once(kind, f"guest attributes: writing {NAMESPACE}/{key} failed ({error}); {again}")

    def _write(self, key: str, value: str, deadline: float) -> MetadataError | None:
        """One PUT (one try: the pacing above is the retry policy); the error, or None when written."""
        try:
            path = f"{GUEST_ATTRIBUTES}{NAMESPACE}/{key}"
            self.client.put(path, value, deadline_s=deadline, max_tries=1)
        except MetadataError as exc:
            return exc
        if self._logged:
            log.info("guest attributes: written again (was: %s)", ", ".join(sorted(self._logged)))
            self._logged.clear()
        return None

    def _once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s", message)
