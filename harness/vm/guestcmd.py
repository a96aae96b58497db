"""Host side of the guest command server (``guest/guestcmd.py``) on the VM's ttyS1.

QEMU exposes the guest's second serial port as a unix socket
(``-chardev socket,server=on,wait=off``). Requests and replies are JSON lines
with base64 payloads, so any bytes survive. Several requests may be in flight
(one per thread); a reader thread files each reply under its id.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hostenv import connect_unix

# guestcmd kills a command at its timeout; this much more covers the transfer back.
TRANSPORT_MARGIN = 15.0


class GuestCmdError(RuntimeError):
    """guestcmd did not answer in time, or the channel broke."""


class CommandFailed(AssertionError):
    """A guest command exited non-zero (raised by ``check=True``); the message has all output."""

    def __init__(self, result: Result) -> None:
        self.result = result
        super().__init__(result.describe())


@dataclass(frozen=True)
class Result:
    """The outcome of one guest command. ``stdout``/``stderr`` are text; ``*_bytes`` exact."""

    command: Sequence[str] | str
    user: str | None
    rc: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool = False
    duration: float = 0.0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode(errors="replace")

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def describe(self) -> str:
        cmd = self.command if isinstance(self.command, str) else " ".join(self.command)
        what = "timed out" if self.timed_out else f"exited {self.rc}"
        return (
            f"guest command {what} (user={self.user or 'root'}, {self.duration:.1f}s): {cmd}\n"
            f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
        )

    def check(self) -> Result:
        """Self if the command succeeded, else raise CommandFailed with the full output."""
        if not self.ok:
            raise CommandFailed(self)
        return self


class GuestCmdClient:
    """Connection to guestcmd through QEMU's chardev socket at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader: threading.Thread | None = None
        self.noise = bytearray()  # non-JSON bytes from the line, for diagnostics
        self.ready_events: list[dict[str, Any]] = []

    def connect(self, timeout: float = 10.0) -> None:
        sock = connect_unix(self.path, timeout)
        if sock is None:
            raise GuestCmdError(f"guestcmd socket {self.path} not ready after {timeout:.0f}s")
        self._sock = sock
        self._reader = threading.Thread(target=self._read_loop, name="guestcmd-reader", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        assert self._sock is not None
        buf = b""
        try:
            while True:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._file(line)
        except OSError:
            pass
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _file(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            self.noise += line[-4096:] + b"\n"
            del self.noise[:-65536]
            return
        kind = msg.get("kind") if isinstance(msg, dict) else None
        if kind not in ("reply", "pong", "ready"):
            # Our own request echoed by the guest tty before guestcmd made it raw.
            self.noise += line[-4096:] + b"\n"
            del self.noise[:-65536]
            return
        with self._cond:
            if kind == "ready":
                self.ready_events.append(msg)
            elif isinstance(msg.get("id"), int):
                self._replies[msg["id"]] = msg
            self._cond.notify_all()

    def request(self, payload: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait at most ``timeout`` s for its reply."""
        if self._sock is None:
            raise GuestCmdError("guestcmd not connected")
        msg_id = next(self._ids)
        data = json.dumps({**payload, "id": msg_id}, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            raise GuestCmdError(f"guestcmd channel: {exc}") from exc
        deadline = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._replies:
                left = deadline - time.monotonic()
                if self._closed:
                    raise GuestCmdError("guestcmd channel closed (QEMU exited?)")
                if left <= 0:
                    raise GuestCmdError(f"no answer from the guestcmd within {timeout:.0f}s")
                self._cond.wait(left)
            return self._replies.pop(msg_id)

    def ready_count(self) -> int:
        """A mark for :meth:`wait_ready`: only ready events after it count."""
        with self._cond:
            return len(self.ready_events)

    def wait_ready(self, since: int = 0, timeout: float = 1.0) -> dict[str, Any] | None:
        """The first ``ready`` event (sent once per guestcmd start) after mark ``since``, or None.

        Waiting for it instead of pinging keeps the host silent until guestcmd has
        made the line raw, so nothing is echoed back.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.ready_events) <= since:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            return self.ready_events[since]

    def ping(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """guestcmd's pong (boot_id, uptime), or None if it did not answer in time."""
        try:
            pong = self.request({"op": "ping"}, timeout)
            return pong if pong.get("kind") == "pong" else None
        except GuestCmdError:
            if self._closed:
                raise
            return None

    def run(
        self,
        command: Sequence[str] | str,
        *,
        user: str | None = None,
        timeout: float = 60.0,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> Result:
        """Run ``command`` (argv list, or a string for ``/bin/sh -c``) in the guest."""
        payload: dict[str, Any] = {"timeout": timeout, "user": user}
        if isinstance(command, str):
            payload["sh"] = command
        else:
            payload["argv"] = [os.fspath(a) for a in command]
        if stdin is not None:
            raw = stdin.encode() if isinstance(stdin, str) else stdin
            payload["stdin"] = base64.b64encode(raw).decode("ascii")
        if env:
            payload["env"] = dict(env)
        if cwd:
            payload["cwd"] = cwd
        start = time.monotonic()
        reply = self.request(payload, timeout + TRANSPORT_MARGIN)
        stderr = base64.b64decode(reply.get("stderr") or "")
        if reply.get("error"):
            stderr += f"\n[guestcmd] {reply['error']}\n".encode()
        return Result(
            command=command if isinstance(command, str) else list(payload["argv"]),
            user=user,
            rc=int(reply["rc"]) if reply.get("rc") is not None else -1,
            stdout_bytes=base64.b64decode(reply.get("stdout") or ""),
            stderr_bytes=stderr,
            timed_out=bool(reply.get("timed_out")),
            duration=time.monotonic() - start,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._reader is not None:
            self._reader.join(timeout=5)
