"""sd_notify: READY, STATUS, WATCHDOG and STOPPING for systemd's Type=notify units.

A no-op outside systemd (no NOTIFY_SOCKET), so the daemon runs the same by hand.
"""

from __future__ import annotations

import os

try:
    from systemd import daemon as _sd
except ImportError:  # pragma: no cover - python3-systemd is a hard dependency of the package
    _sd = None


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET")) and _sd is not None
        self.last_status = ""

    def _send(self, text: str) -> None:
        if self.enabled:
            _sd.notify(text)

    def status(self, line: str) -> None:
        if line != self.last_status:
            self.last_status = line
            self._send(f"STATUS={line}")

    def ready(self, line: str) -> None:
        self.last_status = line
        self._send(f"READY=1\nSTATUS={line}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def stopping(self) -> None:
        self._send("STOPPING=1\nSTATUS=stopping")


def watchdog_interval() -> float | None:
    """Half the watchdog timeout systemd asked for, or None when there is no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None
