"""The daemon's metrics endpoint with every prometheus_client from Ubuntu 22.04's 0.9 to Debian 13's
0.21: served over IPv4 and IPv6 loopback, quiet per scrape, a bad address is one warning line; and
what a hostile local client can make it hold, bounded (tpuboot/metrics_server.py): connections,
time (silent, trickling), request size, accept errors, the stop; and `tpuboot run` under a flood
of idle connections beyond its fd limit, its watchdog, STATUS, tpu-env writes and scrapes intact.

The library matrix (scripts/test-matrix) runs this module against each of those versions.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.audit import audit_events
from tests.unit.helpers.runproc import free_port, tpuboot_run
from tpuboot import metrics, metrics_export, metrics_server
from tpuboot.config import MetricsConfig
from tpuboot.metrics_server import MetricsServer


@pytest.fixture(autouse=True)
def fresh() -> Iterator[metrics.Metrics]:
    with metrics.use(metrics.Metrics()) as m:
        yield m


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    """The endpoint on 127.0.0.1, a short deadline per connection; shut down at the end."""
    served = metrics_export.serve(MetricsConfig(address="127.0.0.1", port=0))
    assert served is not None
    served.deadline = 0.5
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _scrape(server: object, host: str) -> str:
    port = server.server_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return response.read().decode()


@pytest.mark.parametrize(
    ("address", "url_host", "family"),
    [
        ("127.0.0.1", "127.0.0.1", socket.AF_INET),
        pytest.param(
            "::1",
            "[::1]",
            socket.AF_INET6,
            marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host"),
        ),
    ],
)
def test_served_on_the_configured_loopback_address(address: str, url_host: str, family: int) -> None:
    metrics.bind_attempt("bound", 0.1)
    server = metrics_export.serve(MetricsConfig(address=address, port=0))
    assert server is not None
    try:
        assert server.socket.family == family
        body = _scrape(server, url_host)
    finally:
        server.shutdown()
        server.server_close()
    assert 'tpuboot_bind_attempts_total{result="bound"} 1.0' in body


def test_a_scrape_writes_no_access_log_line(capfd: pytest.CaptureFixture[str]) -> None:
    server = metrics_export.serve(MetricsConfig(address="127.0.0.1", port=0))
    assert server is not None
    try:
        _scrape(server, "127.0.0.1")
        _scrape(server, "127.0.0.1")
    finally:
        server.shutdown()
        server.server_close()
    out, err = capfd.readouterr()
    assert "GET /metrics" not in out + err


def test_scrapes_run_in_daemon_threads(server: MetricsServer) -> None:
    """A scrape still being answered never holds the daemon's exit."""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5):
        wait_until(lambda: server.connections == 1)
        scrapes = [t for t in threading.enumerate() if t.name == "tpuboot-metrics-scrape"]
        assert scrapes and all(t.daemon for t in scrapes)


def test_an_address_that_does_not_resolve_is_one_warning_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_such_name(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)  # no resolver asked, whatever the host
    assert metrics_export.serve(MetricsConfig(address="no-such-host.invalid", port=0)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-host.invalid" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


# --- what a client can make the endpoint hold -----------------------------------------------------


def _connect(server: MetricsServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_port), timeout=20)


def test_a_connection_that_sends_nothing_is_closed_at_its_deadline(server: MetricsServer) -> None:
    with _connect(server) as idle:
        assert idle.recv(1) == b""  # closed by the server, not by this recv's 20 s timeout


def test_a_request_trickled_a_byte_at_a_time_ends_at_the_deadline(server: MetricsServer) -> None:
    """Each byte comes well inside any per-receive timeout: only a deadline on the whole ends it."""
    request = b"GET /metrics HTTP/1.0\r\n" + b"X-Slow: " + b"a" * 400
    with _connect(server) as slow:
        sent = 0
        with pytest.raises(OSError):  # the server's end: reset or broken pipe, then EOF
            for byte in request:
                slow.sendall(bytes([byte]))
                sent += 1
                threading.Event().wait(0.02)
                if server.connections == 0:
                    assert slow.recv(1) == b""
                    raise ConnectionResetError("closed by the server")
    assert sent < len(request)


@pytest.mark.parametrize("shape", ["few long headers", "many headers", "a long request line"])
def test_a_request_larger_than_a_scrape_is_refused_unread(server: MetricsServer, shape: str) -> None:
    head = {
        "few long headers": b"".join(b"X-%d: %s\r\n" % (i, b"a" * 60000) for i in range(40)),
        "many headers": b"".join(b"X-%d: a\r\n" % i for i in range(5000)),
        "a long request line": b"",
    }[shape]
    line = b"GET /metrics?" + b"a" * 60000 + b" HTTP/1.0\r\n" if shape == "a long request line" else b""
    request = (line or b"GET /metrics HTTP/1.0\r\n") + head + b"\r\n"
    with _connect(server) as client:
        sender = threading.Thread(target=_send_ignoring_errors, args=(client, request), daemon=True)
        sender.start()
        answer = b""
        with _suppress_reset():
            while chunk := client.recv(4096):
                answer += chunk
        sender.join(20)
    assert not answer.startswith(b"HTTP/1.0 200"), answer[:80]
    assert answer == b"" or answer.split(b" ", 2)[1] in (b"414", b"431"), answer[:80]


def _send_ignoring_errors(sock: socket.socket, data: bytes) -> None:
    with _suppress_reset():
        sock.sendall(data)


def _suppress_reset() -> contextlib.suppress:
    return contextlib.suppress(ConnectionResetError, BrokenPipeError)


def test_connections_beyond_the_cap_wait_in_the_backlog_and_scrapes_resume(server: MetricsServer) -> None:
    server.max_connections = 3
    server.deadline = 30.0  # the idle ones hold their slots for the whole test
    idle = [_connect(server) for _ in range(10)]
    try:
        wait_until(lambda: server.connections == 3)
        for _ in range(20):  # the other seven stay in the kernel's backlog, not in the daemon
            assert server.connections <= 3
            assert sum(t.name == "tpuboot-metrics-scrape" for t in threading.enumerate()) <= 3
            threading.Event().wait(0.01)
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: server.connections == 0)
    assert "tpuboot_build_info" in _scrape(server, "127.0.0.1")


def test_shutdown_never_connects_to_its_own_address_and_cuts_open_connections(server: MetricsServer) -> None:
    """With IPAddressAllow= that excludes it, a knock on its own port would never be answered."""
    server.deadline = 60.0
    with _connect(server) as held:
        wait_until(lambda: server.connections == 1)
        with audit_events() as events:
            server.shutdown()
        assert held.recv(1) == b""  # cut at once, not after its 60 s
    connects = [args for event, args in events if event == "socket.connect"]
    assert connects == []
    wait_until(lambda: server.connections == 0)  # its thread has let go


class _Listener:
    """The server's listening socket, whose accept() fails with EMFILE a given number of times."""

    def __init__(self, real: socket.socket, failures: int) -> None:
        self.real = real
        self.failures = failures
        self.calls = 0

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return self.real.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


class _RecordingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.waits.append(timeout)
        return super().wait(0 if timeout is None else min(timeout, 0.01))


def test_accept_out_of_fds_backs_off_and_logs_once_instead_of_spinning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def app(environ: object, start_response: Callable[..., object]) -> list[bytes]:
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    served = metrics_server.MetricsServer(("127.0.0.1", 0), metrics_server.QuietHandler)
    served.set_app(app)
    listener = _Listener(served.socket, failures=6)
    served.socket = listener  # type: ignore[assignment]
    stop = served._stop = _RecordingEvent()  # type: ignore[assignment]
    with caplog.at_level(logging.INFO, logger="tpuboot.metrics"):
        served.start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{served.server_port}/", timeout=20) as answer:
                assert answer.read() == b"ok"  # served once the fds are back
        finally:
            served.shutdown()
            served.server_close()
    assert listener.calls >= 7
    assert stop.waits[:6] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]  # one wait per failure, doubling
    lines = [r.getMessage() for r in caplog.records]
    assert sum("cannot take a scrape connection (accept: Too many open files)" in m for m in lines) == 1
    assert sum("accepting scrapes again" in m for m in lines) == 1


# --- tpuboot run under a flood ----------------------------------------------------------------------

NOFILE = 64


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Flood:
    """A local client opening idle connections to ``port`` one every 5 ms and holding each open
    (up to ``most``), until :meth:`end`: those the kernel's queue has no room for stay in their
    handshake, retried by the kernel, as an attacker's would."""

    def __init__(self, port: int, most: int) -> None:
        self.port = port
        self.most = most
        self.sockets: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self.thread.start()

    @property
    def held(self) -> int:
        return len(self.sockets)

    def _run(self) -> None:
        while not self.stop.is_set() and len(self.sockets) < self.most:
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", self.port))
            self.sockets.append(sock)
            self.stop.wait(0.005)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(20)
        for sock in self.sockets:
            sock.close()


def _entries(port: int) -> list[list[str]]:
    """The fields of /proc/net/tcp's entries whose local address is 127.0.0.1:``port``, from one
    reading of it (which, while connections come and go, can list an entry more than once)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [fields for fields in (line.split() for line in lines) if fields[1] == f"0100007F:{port:04X}"]


def _listening(port: int) -> bool:
    """A socket in LISTEN on 127.0.0.1:``port``: seen without connecting to it."""
    return any(fields[3] == "0A" for fields in _entries(port))


def _connections(port: int) -> tuple[int, int]:
    """The daemon's side of 127.0.0.1:``port`` from one reading of /proc/net/tcp: the connections
    it accepted, and those the kernel completed that wait in the listening socket's accept queue
    (its rx_queue). Both are ESTABLISHED entries of that local address until the daemon closes;
    each is counted once, by its peer's address (:func:`_entries` can list one twice)."""
    established: set[str] = set()
    queued = 0
    for fields in _entries(port):
        if fields[3] == "0A":  # LISTEN
            queued = int(fields[4].split(":")[1], 16)
        elif fields[3] == "01":  # ESTABLISHED
            established.add(fields[2])
    return len(established) - queued, queued


def _held_connections(pid: int, port: int) -> int:
    """The connections to 127.0.0.1:``port`` process ``pid`` holds open: its socket fds whose inode
    /proc/net/tcp lists as an ESTABLISHED entry of that local address, each counted once
    (:func:`_entries` can list one twice)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return len({fields[9] for fields in _entries(port) if fields[3] == "01" and fields[9] in inodes})


def test_a_flood_of_idle_connections_beyond_the_fd_limit_leaves_the_daemon_whole(
    tmp_path: Path, emulator: MetadataEmulator
) -> None:
    """More idle connections than the daemon has fds: its watchdog keeps beating, STATUS and the
    tpu-env file follow a change, its fds stay under the limit, and scrapes work once it ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * NOFILE + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    kernel = FakeKernel(tmp_path / "root")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    port = free_port()
    config = (
        "vbar: {enabled: false}\nguest_attributes: {enabled: false}\n"
        f"metrics: {{address: 127.0.0.1, port: {port}}}\nmetadata: {{boot_deadline: 20, watch: true}}\n"
    )
    environ = {"WATCHDOG_USEC": "400000"}  # WATCHDOG=1 every 0.2 s
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path, env=environ, nofile=NOFILE) as daemon:
        daemon.receive("READY=1")
        pid = daemon.process.pid
        scraped: list[str] = []

        def scrape() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    scraped.append(response.read().decode())
            except OSError:
                return False
            return True

        # The endpoint opens in its own thread (READY never waits for it); looked for without a
        # connection, which the flood's count would take for one of its own.
        wait_until(lambda: _listening(port), timeout=30)
        flood = Flood(port, 4 * NOFILE)
        try:
            # The flood is in full once the daemon holds its share and takes no more (at its cap;
            # before, at EMFILE), so the kernel's queue behind it fills, and the flood holds more
            # connections than the daemon has fds (on a loaded machine its thread gets there late).
            cap = min(metrics_server.MAX_CONNECTIONS, NOFILE // 4)

            def in_full() -> bool:
                # Counted as connections, not as the daemon's fds, which its own files and
                # requests of the moment add to.
                taken, queued = _connections(port)
                return taken >= cap and queued >= 5 and flood.held > NOFILE

            wait_until(in_full, timeout=30)
            for _ in range(5):
                daemon.receive("WATCHDOG=1", within=20)
            emulator.set_attribute("tpu-env", "WORKER_ID: '7'\n")
            daemon.receive("; tpu-env: 1 key from metadata", within=30)  # STATUS=
            assert (kernel.top / "home/tpu-runtime/tpu-env").read_text() == 'WORKER_ID="7"\n'
            daemon.receive("WATCHDOG=1", within=20)
            # Its share, no more (counted as its sockets, not as fds, which a file or a metadata
            # call of its own in that moment would add to), and its fds under their limit.
            assert _held_connections(pid, port) <= cap
            assert _fds(pid) < NOFILE
        finally:
            flood.end()
        assert flood.held > NOFILE  # more connections held open than the daemon has fds
        scraped.clear()
        wait_until(scrape, timeout=30)
        assert 'tpuboot_metadata_requests_total{outcome="ok"}' in scraped[0]
        daemon.process.send_signal(signal.SIGTERM)
        daemon.receive("STOPPING=1", 20)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0
    assert "Traceback" not in daemon.stderr, daemon.stderr
    assert "Too many open files" not in daemon.stderr, daemon.stderr
