"""The daemon's metrics endpoint with every prometheus_client from Ubuntu 22.04's 0.9 to Debian 13's
0.21: served over IPv4 and IPv6 loopback, quiet per scrape, a bad address is one warning line.

The library matrix (scripts/test-matrix) runs this module against each of those versions.
"""

from __future__ import annotations

import logging
import socket
import urllib.request
from collections.abc import Iterator

import pytest

from tpuboot import metrics
from tpuboot.config import MetricsConfig


@pytest.fixture(autouse=True)
def fresh() -> Iterator[metrics.Metrics]:
    with metrics.use(metrics.Metrics()) as m:
        yield m


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
    server = metrics.serve(MetricsConfig(address=address, port=0))
    assert server is not None
    try:
        assert server.socket.family == family
        body = _scrape(server, url_host)
    finally:
        server.shutdown()
        server.server_close()
    assert 'tpuboot_bind_attempts_total{result="bound"} 1.0' in body


def test_a_scrape_writes_no_access_log_line(capfd: pytest.CaptureFixture[str]) -> None:
    server = metrics.serve(MetricsConfig(address="127.0.0.1", port=0))
    assert server is not None
    try:
        _scrape(server, "127.0.0.1")
        _scrape(server, "127.0.0.1")
    finally:
        server.shutdown()
        server.server_close()
    out, err = capfd.readouterr()
    assert "GET /metrics" not in out + err


def test_scrapes_run_in_daemon_threads() -> None:
    """A scrape still being answered never holds the daemon's exit."""
    server = metrics.serve(MetricsConfig(address="127.0.0.1", port=0))
    assert server is not None
    try:
        assert getattr(server, "daemon_threads", False) is True
    finally:
        server.shutdown()
        server.server_close()


def test_an_address_that_does_not_resolve_is_one_warning_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_such_name(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)  # no resolver asked, whatever the host
    assert metrics.serve(MetricsConfig(address="no-such-host.invalid", port=0)) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-host.invalid" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
