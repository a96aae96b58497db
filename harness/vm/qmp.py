"""A small QMP (QEMU Machine Protocol) client over a unix socket.

Enough for the bench: capability negotiation, synchronous commands, and an
event log that callers wait on with a predicate (hot-unplug completes only
when the guest has ejected the device, announced by DEVICE_DELETED).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .hostenv import connect_unix


class QMPError(RuntimeError):
    """QEMU answered a command with an error, or the connection failed."""


Event = dict[str, Any]


class QMPClient:
    """One QMP connection; a reader thread files replies by id and keeps every event."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[Event] = []
        self._closed = False
        self._reader: threading.Thread | None = None

    def connect(self, timeout: float = 10.0) -> None:
        """Connect (QEMU creates the socket at start-up), read the greeting, negotiate."""
        sock = connect_unix(self.path, timeout)
        if sock is None:
            raise QMPError(f"QMP socket {self.path} not ready after {timeout:.0f}s")
        self._sock = sock
        sock.settimeout(timeout)
        greeting = self._readline_blocking(sock)
        if "QMP" not in greeting:
            raise QMPError(f"unexpected QMP greeting: {greeting}")
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_loop, name="qmp-reader", daemon=True)
        self._reader.start()
        self.execute("qmp_capabilities")

    def _readline_blocking(self, sock: socket.socket) -> dict[str, Any]:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(1)
            if not chunk:
                raise QMPError("QMP connection closed during greeting")
            buf += chunk
        greeting: dict[str, Any] = json.loads(buf)
        return greeting

    def _read_loop(self) -> None:
        assert self._sock is not None
        reader = self._sock.makefile("rb")
        try:
            for line in reader:
                msg = json.loads(line)
                with self._cond:
                    if "event" in msg:
                        self.events.append(msg)
                    elif isinstance(msg.get("id"), int):
                        self._replies[msg["id"]] = msg
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def execute(self, command: str, timeout: float = 30.0, **arguments: Any) -> Any:
        """Run ``command`` and return its ``return`` value; QMPError on an error reply."""
        if self._sock is None:
            raise QMPError("QMP not connected")
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"execute": command, "id": msg_id}
        if arguments:
            msg["arguments"] = arguments
        try:
            self._sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as exc:
            raise QMPError(f"QMP {command}: {exc}") from exc
        deadline = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if self._closed:
                    raise QMPError(f"QMP {command}: connection closed (QEMU exited?)")
                if left <= 0:
                    raise QMPError(f"QMP {command}: no reply within {timeout:.0f}s")
                self._cond.wait(left)
            reply = self._replies.pop(msg_id)
        if "error" in reply:
            err = reply["error"]
            raise QMPError(f"QMP {command} {arguments}: {err.get('class')}: {err.get('desc')}")
        return reply.get("return")

    def event_count(self) -> int:
        """A mark to pass to :meth:`wait_event` so only later events match."""
        with self._cond:
            return len(self.events)

    def wait_event(
        self,
        name: str,
        *,
        since: int = 0,
        match: Callable[[Event], bool] | None = None,
        timeout: float = 30.0,
    ) -> Event:
        """The first event ``name`` (after mark ``since``) for which ``match`` holds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events[since:]:
                    if event["event"] == name and (match is None or match(event)):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QMPError(f"no QMP event {name} within {timeout:.0f}s")
                if self._closed:
                    raise QMPError(f"waiting for {name}: QMP connection closed")
                self._cond.wait(left)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._reader is not None:
            self._reader.join(timeout=5)
