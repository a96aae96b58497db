"""sd_notify through the real python-systemd (234 on Ubuntu 22.04, 235 elsewhere): what systemd
reads on NOTIFY_SOCKET when the daemon reports STATUS, READY, WATCHDOG and STOPPING.
The daemon tests record the notifier's calls instead; this is the library end of them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpuboot.notify import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's, named in NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def test_the_daemon_s_notifications_reach_the_socket(notify_socket: socket.socket) -> None:
    notifier = Notifier()
    assert notifier.enabled
    notifier.status("binding 4 TPUs")
    notifier.status("binding 4 TPUs")  # unchanged: not sent again
    notifier.ready("4 TPUs bound")
    notifier.watchdog()
    notifier.stopping()
    received = []
    notify_socket.setblocking(False)
    while True:
        try:
            received.append(notify_socket.recv(4096).decode())
        except BlockingIOError:
            break
    assert received == [
        "STATUS=binding 4 TPUs",
        "READY=1\nSTATUS=4 TPUs bound",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=stopping",
    ]


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    notifier.ready("by hand")  # no systemd: a no-op, not an error


def _received(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_a_send_that_fails_never_raises_and_what_systemd_missed_goes_with_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """systemd's socket gone for a while (or no fd to make one): READY and the latest STATUS reach
    it with the next notification, the watchdog's at the latest; one warning, one recovery line."""
    path = tmp_path / "notify"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))  # nothing listens there yet: ENOENT
    notifier = Notifier()
    with caplog.at_level("INFO", logger="tpuboot.notify"):
        notifier.ready("4 TPUs bound")
        notifier.watchdog()
        notifier.status("3 of 4 TPUs bound")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(path))
            notifier.watchdog()
            notifier.watchdog()
            received = _received(sock)
    assert received == ["READY=1\nSTATUS=3 of 4 TPUs bound\nWATCHDOG=1", "WATCHDOG=1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("sd_notify failed (")
    assert any(r.getMessage().startswith("sd_notify works again") for r in caplog.records)


def test_stopping_drops_a_ready_systemd_never_got(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notifier = Notifier()
    notifier.ready("starting")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        notifier.stopping()
        assert _received(sock) == ["STOPPING=1\nSTATUS=stopping"]
