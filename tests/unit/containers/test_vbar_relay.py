"""The vBar relay (tpuboot/containers/vbar_relay.py) on real sockets: a unix socket in a temporary
root relayed to a stand-in vBar on 127.0.0.1. Every wait here is for an event (a byte, an EOF, a
count), never for time."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.listeners import Silent
from tests.unit.helpers.daemon import until
from tpuboot.checks.cdi import CdiChecks, probe_relay
from tpuboot.config import Config
from tpuboot.containers.cdi import RELAY_DIR, RELAY_SOCKET
from tpuboot.containers.vbar_relay import VbarRelay
from tpuboot.devices.table import DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.endpoints import Endpoint
from tpuboot.paths import Root


@pytest.fixture
def vbar() -> Iterator[Silent]:
    """vBar's stand-in: accepts on 127.0.0.1, hands each connection to the test."""
    with Silent() as stand_in:
        yield stand_in


@pytest.fixture
def root(tmp_path: Path) -> Root:
    (tmp_path / "root").mkdir()
    return Root(tmp_path / "root")


def relay_of(root: Root, port: int, **kwargs: object) -> VbarRelay:
    relay = VbarRelay(root, Endpoint(host="127.0.0.1", port=port), **kwargs)  # type: ignore[arg-type]
    relay.start()
    return relay


def connect(root: Root) -> socket.socket:
    """A client of the relay socket (through its directory's descriptor: a deep tmp path is long)."""
    fd = os.open(root.path(RELAY_DIR), os.O_PATH | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(f"/proc/self/fd/{fd}/vbar.sock")
    finally:
        os.close(fd)
    sock.settimeout(30)  # a bound on a broken relay, never a timed assertion
    return sock


def test_bytes_go_both_ways_and_a_half_close_reaches_the_other_side(root: Root, vbar: Silent) -> None:
    relay = relay_of(root, vbar.port)
    try:
        path = root.path(RELAY_SOCKET)
        assert stat.S_ISSOCK(path.stat().st_mode) and path.stat().st_mode & 0o777 == 0o666
        assert root.path(RELAY_DIR).stat().st_mode & 0o777 == 0o755
        client = connect(root)
        client.sendall(b"GET / HTTP/1.0\r\n\r\n")
        until(lambda: vbar.accepted)
        upstream = vbar.accepted[0]
        assert upstream.recv(100) == b"GET / HTTP/1.0\r\n\r\n"
        client.shutdown(socket.SHUT_WR)  # the client sends no more ...
        assert upstream.recv(100) == b""  # ... vBar sees the end
        upstream.sendall(b"HTTP/1.0 200 OK\r\n")  # and still answers
        upstream.close()
        got = b""
        while chunk := client.recv(100):
            got += chunk
        assert got == b"HTTP/1.0 200 OK\r\n"
        client.close()
        until(lambda: relay.connections == 0)
    finally:
        relay.stop()
    assert not root.path(RELAY_SOCKET).exists()  # stop removes the socket


def test_vbar_down_closes_the_client_at_once(root: Root) -> None:
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    relay = relay_of(root, port)
    try:
        client = connect(root)
        assert client.recv(1) == b""  # EOF: the connect to vBar was refused
        assert relay.connections == 0
        assert "vBar refused it" in (probe_relay(root, 30.0) or "")
    finally:
        relay.stop()


def test_connections_over_the_cap_are_closed_at_accept(root: Root, vbar: Silent) -> None:
    relay = relay_of(root, vbar.port, max_connections=2)
    try:
        kept = [connect(root), connect(root)]
        until(lambda: relay.connections == 2)
        extra = connect(root)
        assert extra.recv(1) == b""  # closed: two are relayed already
        kept[0].sendall(b"x")
        until(lambda: len(vbar.accepted) == 2)
        assert relay.connections == 2
        for sock in [*kept, *vbar.accepted]:  # both ends of each: a half-closed one is kept open
            sock.close()
        until(lambda: relay.connections == 0)
        again = connect(root)
        until(lambda: relay.connections == 1)  # room again
        again.close()
    finally:
        relay.stop()


def test_an_idle_connection_is_closed(root: Root, vbar: Silent) -> None:
    now = [0.0]
    relay = relay_of(root, vbar.port, idle_timeout=0.05, clock=lambda: now[0])
    try:
        client = connect(root)
        until(lambda: relay.connections == 1)
        now[0] = 1.0  # the relay's clock says a second has passed: longer than its idle timeout
        client.sendall(b"")  # nothing moves; the relay wakes at its timeout and looks at its clock
        assert client.recv(1) == b""
        assert relay.connections == 0
    finally:
        relay.stop()


def test_a_client_that_never_reads_holds_at_most_one_buffer(root: Root, vbar: Silent) -> None:
    """vBar sends 16 MiB to a client that reads nothing: the relay stops reading from vBar once its
    buffer for that direction is full, so vBar's send blocks and the relay's memory stays bounded."""
    buffer = 4096
    relay = relay_of(root, vbar.port, buffer=buffer)
    try:
        client = connect(root)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(b"go")
        until(lambda: vbar.accepted)
        upstream = vbar.accepted[0]
        finished = threading.Event()

        def flood() -> None:
            with contextlib.suppress(OSError):
                upstream.sendall(b"x" * (16 << 20))
            finished.set()

        threading.Thread(target=flood, daemon=True).start()
        until(lambda: relay.buffered() == buffer)  # the client's side is full and the buffer too
        assert not finished.is_set()  # so vBar's 16 MiB are not all taken
        assert relay.buffered() <= 2 * buffer
        got = 0
        while got < (16 << 20):  # the client reads at last: every byte arrives
            chunk = client.recv(1 << 20)
            assert chunk
            got += len(chunk)
        assert got == 16 << 20
        finished.wait(30)
        assert finished.is_set()
    finally:
        relay.stop()


def test_doctor_says_whether_a_container_reaches_vbar(root: Root, vbar: Silent) -> None:
    from tpuboot.config import VbarConfig

    config = Config(vbar=VbarConfig(endpoint=Endpoint(host="127.0.0.1", port=vbar.port)))
    checks = CdiChecks(root, Binder(root, DeviceTable(), config.vfio), config=config, relay_wait=0.2)
    assert checks.check_vbar_relay().status == "SKIP"  # no relay directory in this tree
    relay = relay_of(root, vbar.port)
    try:
        result = checks.check_vbar_relay()
        assert result.status == "PASS" and "unix:///var/run/tpu-plugin/vbar.sock" in result.detail
        vbar.stop_listening()
        result = checks.check_vbar_relay()
        assert result.status == "FAIL" and result.detail.startswith("a container could not reach vBar")
        assert "systemctl restart tpuboot" in result.fix
    finally:
        relay.stop()
    result = checks.check_vbar_relay()
    assert result.status == "FAIL" and "does not answer" in result.detail
