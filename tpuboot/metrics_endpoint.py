"""The daemon's metrics endpoint, opened in a thread of its own once READY=1 went out.

READY never waits for it: tpuboot/metrics.py records without prometheus_client, and the endpoint
is an after-boot part (tpuboot/daemon.py); its import of prometheus_client
(tpuboot/metrics_export.py), its collectors and its port come in its own thread. A failure to
open (a port in use is a warning of :func:`~tpuboot.metrics_export.serve`; anything else is a bug,
logged with its traceback) leaves the daemon running without metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpuboot.component import Part, Report
from tpuboot.eventloop import nothing

if TYPE_CHECKING:
    from tpuboot.metrics_server import MetricsServer

log = logging.getLogger("tpuboot.metrics")


class MetricsEndpoint(Part):
    """``open`` (it returns the running server, or None without one) called in a thread by
    :meth:`start`; :meth:`stop` shuts the server down, also one that opens after it. A part of the
    daemon with no line in STATUS; it stops last, so the stop can be scraped to its end."""

    name = "metrics endpoint"
    stops_after_metadata = True

    def __init__(self, open: Callable[[], MetricsServer | None]) -> None:
        self._open = open
        self._lock = threading.Lock()
        self._server: MetricsServer | None = None
        self._closed = False

    @property
    def server(self) -> MetricsServer | None:
        with self._lock:
            return self._server

    def dump(self) -> str:
        """SIGUSR1's words: the scrapes being served now ("off": not open, or not yet)."""
        server = self.server
        return f"metrics connections {'off' if server is None else server.connections}"

    def start(self, report: Report = nothing) -> None:
        threading.Thread(target=self._run, name="tpuboot-metrics-open", daemon=True).start()

    def _run(self) -> None:
        try:
            server = self._open()
        except Exception:  # a bug: the daemon runs on without metrics, and says so
            log.exception("metrics: the endpoint did not open; running without metrics, please report it")
            return
        with self._lock:
            if not self._closed:
                self._server = server
                return
        _shut(server)  # closed while it opened

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
        _shut(server)


def _shut(server: MetricsServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
