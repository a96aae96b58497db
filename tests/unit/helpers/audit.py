"""The test process's one audit hook (PEP 578): the loopback guard of tests/unit/conftest.py's
autouse fixture, and the recorders of :func:`audit_events`.

Installed when this module is first imported (by the conftest, before any test), once: audit
hooks cannot be removed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
from collections.abc import Iterator


def _is_loopback(address: object) -> bool:
    host = str(address[0]) if isinstance(address, tuple) and address else str(address)
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


class _Audit:
    """The test process's one audit hook: the loopback guard, and the recorders of audit_events."""

    def __init__(self) -> None:
        self.guard = False
        self.recorders: list[list[tuple[str, tuple[object, ...]]]] = []

    def __call__(self, event: str, args: tuple[object, ...]) -> None:
        if self.guard and event == "socket.connect":
            sock, address = args
            inet = isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6)
            if inet and not _is_loopback(address):
                raise AssertionError(f"test tried to connect to {address!r}; tests may only reach 127.0.0.1")
        for recorder in list(self.recorders):
            recorder.append((event, args))


AUDIT = _Audit()
sys.addaudithook(AUDIT)


@contextlib.contextmanager
def audit_events() -> Iterator[list[tuple[str, tuple[object, ...]]]]:
    """The audit events (``os.listdir``, ``open``, ...) raised in the block, by any thread."""
    seen: list[tuple[str, tuple[object, ...]]] = []
    AUDIT.recorders.append(seen)
    try:
        yield seen
    finally:
        AUDIT.recorders.remove(seen)
