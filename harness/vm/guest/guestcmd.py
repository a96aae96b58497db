#!/usr/bin/python3
"""Guest command server (guestcmd) of the tpuboot test bench (runs inside the VM, stdlib only).

The VM has no network card, so the host drives the guest through the second
ISA serial port (8250 is built into Debian's kernel: no extra PCI device that
could disturb the device tests). Protocol, one JSON object per line each way:

    request  {"id": 7, "argv": [...] | "sh": "...", "user": null | "tester",
              "timeout": 60, "stdin": base64 | null, "env": {...}, "cwd": "/"}
             {"id": 8, "op": "ping"}
    reply    {"kind": "reply", "id": 7, "rc": 0, "stdout": base64, "stderr": base64,
              "timed_out": false, "error": null}
             {"kind": "pong", "id": 8, "boot_id": "...", "uptime": 12.3}
             {"kind": "ready", "boot_id": "..."}   (once, at start)

Every message from guestcmd carries "kind": until guestcmd has switched the
line to raw mode, the tty echoes what the host sent, and the host must be
able to tell such an echo from an answer. Requests run concurrently, each in
its own session so a timeout kills the whole process group. Lines that are not
JSON (bytes left in the UART from before guestcmd opened it) are ignored.
"""

from __future__ import annotations

import base64
import contextlib
import grp
import json
import os
import pwd
import signal
import subprocess
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import Any

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GRACE = 5.0  # seconds to collect output after killing a timed-out command


class Channel:
    """The serial line, in raw mode, with whole-line writes under a lock."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
        tty.setraw(self.fd)
        attrs = termios.tcgetattr(self.fd)
        attrs[2] = (attrs[2] | termios.CLOCAL | termios.CREAD) & ~termios.CRTSCTS & ~termios.HUPCL
        attrs[4] = attrs[5] = termios.B115200
        termios.tcsetattr(self.fd, termios.TCSANOW, attrs)
        termios.tcflush(self.fd, termios.TCIFLUSH)
        self.lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        with self.lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]

    def lines(self) -> Iterator[bytes]:
        """Complete lines as they arrive; EOFError if the line hangs up."""
        buf = b""
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("serial line hung up")
            buf += chunk
            *complete, buf = buf.split(b"\n")
            yield from complete


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _identity(user: str | None) -> dict[str, Any]:
    """Popen arguments and environment for running as ``user`` (None: root)."""
    entry = pwd.getpwnam(user or "root")
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": entry.pw_dir,
        "USER": entry.pw_name,
        "LOGNAME": entry.pw_name,
        "SHELL": entry.pw_shell,
        "LANG": "C.UTF-8",
    }
    if entry.pw_uid == 0:
        return {"env": env, "cwd": "/"}
    groups = [g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem]
    return {
        "env": env,
        "cwd": entry.pw_dir if os.path.isdir(entry.pw_dir) else "/",
        "user": entry.pw_uid,
        "group": entry.pw_gid,
        "extra_groups": groups,
    }


def execute(req: dict[str, Any]) -> dict[str, Any]:
    """Run one request to completion (or timeout) and build its reply."""
    reply: dict[str, Any] = {
        "kind": "reply", "id": req.get("id"), "rc": None, "stdout": "", "stderr": "", "timed_out": False
    }  # fmt: skip
    try:
        argv = ["/bin/sh", "-c", req["sh"]] if "sh" in req else list(req["argv"])
        kwargs = _identity(req.get("user"))
        kwargs["env"].update(req.get("env") or {})
        if req.get("cwd"):
            kwargs["cwd"] = req["cwd"]
        stdin = base64.b64decode(req["stdin"]) if req.get("stdin") is not None else None
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **kwargs,
        )
    except (KeyError, TypeError, ValueError, OSError, subprocess.SubprocessError) as exc:
        reply.update(rc=127, error=f"{type(exc).__name__}: {exc}", stderr=_b64(str(exc).encode()))
        return reply
    try:
        out, err = proc.communicate(stdin, timeout=float(req.get("timeout") or 60))
    except subprocess.TimeoutExpired:
        reply["timed_out"] = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=GRACE)
        except subprocess.TimeoutExpired:
            # A daemonised grandchild still holds the pipes: give up on its output.
            out, err = b"", b"(output lost: a process outside the group kept the pipes open)\n"
    reply.update(rc=proc.wait(), stdout=_b64(out), stderr=_b64(err))
    return reply


def serve(channel: Channel) -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()

    def handle(req: dict[str, Any]) -> None:
        try:
            reply = execute(req)
        except Exception as exc:  # the host must always get an answer
            reply = {"kind": "reply", "id": req.get("id"), "rc": 127, "error": f"guestcmd: {exc!r}"}
        channel.send(reply)

    channel.send({"kind": "ready", "boot_id": boot_id})
    for line in channel.lines():
        try:
            req = json.loads(line)
        except ValueError:
            continue
        if not isinstance(req, dict) or "id" not in req or "kind" in req:
            continue  # not a request (perhaps our own output looped back)
        if req.get("op") == "ping":
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            channel.send({"kind": "pong", "id": req["id"], "boot_id": boot_id, "uptime": uptime})
            continue
        threading.Thread(target=handle, args=(req,), daemon=True).start()


def main() -> int:
    serve(Channel(sys.argv[1] if len(sys.argv) > 1 else "/dev/ttyS1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
