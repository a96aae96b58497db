"""sd_notify: READY, STATUS, WATCHDOG and STOPPING for systemd's Type=notify units.

A no-op outside systemd (no NOTIFY_SOCKET), so the daemon runs the same by hand. A send that fails
(no fd to spare, the socket gone, systemd busy) never raises: it is logged once until a send
succeeds again, and a READY= or STATUS= that did not go is sent with the next notification (the
watchdog's, at the latest), so systemd never misses READY nor keeps showing an old STATUS.
"""

from __future__ import annotations

import logging
import os

from tpuboot.numbers import ascii_int

try:
    from systemd import daemon as _sd
except ImportError:  # pragma: no cover - python3-systemd is a hard dependency of the package
    _sd = None

log = logging.getLogger("tpuboot.notify")


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET")) and _sd is not None
        self.last_status = ""
        self._pending: dict[str, str] = {}  # READY= and STATUS= that have not reached systemd yet
        self._failing: str | None = None  # why sends fail, while they do (logged once)

    def _send(self, text: str) -> None:
        if self.enabled:
            _sd.notify(text)

    def _notify(self, **fields: str) -> None:
        """Send ``fields`` with any still pending; never raises (a failure is logged once per streak)."""
        message = {**{k: v for k, v in self._pending.items() if k not in fields}, **fields}
        try:
            self._send("\n".join(f"{name}={value}" for name, value in message.items()))
        except Exception as exc:  # OSError (EMFILE, ENOBUFS, ECONNREFUSED...), or the library's own
            self._pending = {k: v for k, v in message.items() if k in _KEPT}
            why = f"{type(exc).__name__}: {exc}"
            if self._failing is None:
                log.warning(
                    "sd_notify failed (%s); the daemon goes on and sends it again with the next one",
                    why,
                    extra={"NOTIFY_ERROR": why},
                )
            self._failing = why
            return
        self._pending = {}
        if self._failing is not None:
            log.info("sd_notify works again (was: %s)", self._failing)
            self._failing = None

    def status(self, line: str) -> None:
        if line != self.last_status:
            self.last_status = line
            self._notify(STATUS=line)

    def ready(self, line: str) -> None:
        self.last_status = line
        self._notify(READY="1", STATUS=line)

    def watchdog(self) -> None:
        self._notify(WATCHDOG="1")

    def stopping(self) -> None:
        self.last_status = "stopping"
        self._pending.pop("READY", None)  # never READY after STOPPING
        self._notify(STOPPING="1", STATUS="stopping")


#: What a failed send keeps for the next one: systemd must see READY once, and the latest STATUS.
_KEPT = frozenset({"READY", "STATUS"})


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for, or None when there is no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    micros = ascii_int(usec)
    return None if micros is None else micros / 2_000_000
