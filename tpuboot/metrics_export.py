"""tpuboot's metrics in Prometheus' format: the one module that imports prometheus_client.

A registry per :class:`~tpuboot.metrics.Metrics` (never the global one) shows its recorded values,
plus what is read when Prometheus scrapes (:class:`PcieCollector`, :class:`HolderCollector`); the
daemon serves it on loopback (:func:`serve`, from the endpoint's own thread: tpuboot/daemon.py) and
the one-shot commands write it as a node_exporter textfile (:func:`write_textfile`; the last look at
the slice in a file of its own, :func:`write_slice_textfile`). Each family's name, kind, help and
labels come from its record in :mod:`tpuboot.metrics_catalog`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from tpuboot.atomicfile import write_file
from tpuboot.config import Config, MetricsConfig
from tpuboot.devices.chips import base_address
from tpuboot.devices.health import AER_FILES, read_healths
from tpuboot.devices.pci import tpu_functions
from tpuboot.devices.table import DeviceTable
from tpuboot.metrics import SLICE_TEXTFILE_NAME, TEXTFILE_NAME, Metrics, current
from tpuboot.metrics_catalog import (
    CATALOG,
    CHIP_HOLDERS,
    DUTY_CYCLE,
    LIBTPU_LOCK_HELD,
    MEMORY_TOTAL,
    MEMORY_USED,
    PCIE_BANDWIDTH,
    PCIE_ERRORS,
    PCIE_PRESENT,
    PCIE_SPEED,
    PCIE_WIDTH,
    RUNTIME_HANG,
    RUNTIME_SLICE_ERROR,
    RUNTIME_UP,
    SLICE_FAILURES,
    SLICE_LAST_SWEEP,
    SLICE_PATHS,
    Metric,
    Source,
)
from tpuboot.metrics_server import MetricsServer, QuietHandler
from tpuboot.paths import Root

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from tpuboot.holders.report import Report
    from tpuboot.runtime.collector import Snapshot

log = logging.getLogger("tpuboot.metrics")

Family = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily | InfoMetricFamily


def gauge(metric: Metric) -> GaugeMetricFamily:
    """An empty family of the gauge ``metric`` (its name, help and labels), for its series."""
    _kind(metric, "gauge")
    return GaugeMetricFamily(metric.family, metric.help, labels=list(metric.labels))


def counter(metric: Metric) -> CounterMetricFamily:
    _kind(metric, "counter")
    return CounterMetricFamily(metric.family, metric.help, labels=list(metric.labels))


def _kind(metric: Metric, kind: str) -> None:
    if metric.kind != kind:
        raise ValueError(f"metric {metric.name} is a {metric.kind}, not a {kind}")


def gauges(metric: Metric, series: Iterable[tuple[Sequence[str], float]]) -> GaugeMetricFamily:
    """A gauge family: one series per (label values, value)."""
    family = gauge(metric)
    for key, value in series:
        family.add_metric(list(key), value)
    return family


def shown(metric: Metric, m: Metrics) -> Family:
    """``metric``'s family with the series ``m`` recorded (a snapshot's), whatever its kind."""
    if metric.kind == "counter":
        counts = counter(metric)
        for key, counted in m.counters[metric].items():
            counts.add_metric(list(key), counted.value, created=counted.created)
        return counts
    if metric.kind == "histogram":
        durations = HistogramMetricFamily(metric.family, metric.help, labels=list(metric.labels))
        bounds = [str(float(bound)) for bound in metric.buckets] + ["+Inf"]  # as prometheus_client writes le
        for key, seen in m.histograms[metric].items():
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, seen.counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            durations.add_metric(list(key), buckets, seen.total)
        return durations
    if metric.kind == "info":
        info = InfoMetricFamily(metric.family, metric.help, labels=list(metric.labels))
        for key in m.gauges[metric]:
            info.add_metric(list(key), {})
        return info
    return gauges(metric, m.gauges[metric].items())


class Recorded:
    """The values a :class:`~tpuboot.metrics.Metrics` recorded of the metrics of one source, as
    metric families in the catalog's order, read at each scrape from one snapshot: ``recorded``,
    and the holders apart (``holders``: the daemon shows its own scans instead)."""

    def __init__(self, metrics: Metrics, source: Source) -> None:
        self.metrics = metrics
        self.source = source

    def collect(self) -> Iterator[Family]:
        m = self.metrics.snapshot()
        for metric in CATALOG.of(self.source):
            yield shown(metric, m)


def holder_families(
    holders: Mapping[tuple[str, str], int], locks: Mapping[str, float]
) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """The holder gauges, from the daemon's scan."""
    chips = gauges(CHIP_HOLDERS, holders.items())
    held = gauges(LIBTPU_LOCK_HELD, [((path,), value) for path, value in locks.items()])
    return chips, held


@dataclass
class Exported:
    """One Metrics' registry and the collectors the daemon added to it."""

    registry: CollectorRegistry
    holders: Collector  # the recorded holders, until the daemon's HolderCollector replaces it
    pcie: Collector | None = None
    runtime: Collector | None = None


_exported: weakref.WeakKeyDictionary[Metrics, Exported] = weakref.WeakKeyDictionary()
_exported_lock = threading.Lock()


def exported(metrics: Metrics) -> Exported:
    """``metrics``' registry, made at its first exposition."""
    with _exported_lock:
        found = _exported.get(metrics)
        if found is None:
            registry = CollectorRegistry(auto_describe=True)
            # prometheus_client's Collector ABC exists from 0.14 only: the collectors are cast.
            registry.register(cast("Collector", Recorded(metrics, "recorded")))
            holders = cast("Collector", Recorded(metrics, "holders"))
            registry.register(holders)
            found = _exported[metrics] = Exported(registry, holders)
        return found


def registry_of(metrics: Metrics) -> CollectorRegistry:
    return exported(metrics).registry


def exposition(metrics: Metrics) -> bytes:
    """``metrics`` in Prometheus' text format."""
    return generate_latest(registry_of(metrics))


class PcieCollector:
    """The PCIe health of every TPU function, read from sysfs when Prometheus scrapes: nothing is
    sampled between scrapes (an idle daemon stays asleep) and nothing goes stale."""

    def __init__(self, root: Root, table: DeviceTable) -> None:
        self.root = root
        self.table = table

    def _tpu_addresses(self) -> list[str]:
        return [fn.address for fn, _ in tpu_functions(self.root, self.table)]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        present, ratio, width, speed = map(gauge, (PCIE_PRESENT, PCIE_BANDWIDTH, PCIE_WIDTH, PCIE_SPEED))
        errors = counter(PCIE_ERRORS)
        for address, health in read_healths(self.root, self._tpu_addresses()).items():
            chip = base_address(address)
            present.add_metric([address, chip], 1 if health.present else 0)
            link = health.link
            if link is not None:
                if link.fraction is not None:
                    ratio.add_metric([address, chip], link.fraction)
                for name, lanes, gts in (
                    ("current", link.width, link.speed),
                    ("max", link.max_width, link.max_speed),
                ):
                    if lanes is not None:
                        width.add_metric([address, chip, name], lanes)
                    if gts is not None:
                        speed.add_metric([address, chip, name], gts)
            for severity in AER_FILES:
                total = health.errors(severity)
                if total is not None:
                    errors.add_metric([address, chip, severity], total)
        yield from (present, ratio, width, speed, errors)


class HolderCollector:
    """Who holds each chip and libtpu's locks, for the daemon's endpoint: one /proc scan when
    Prometheus scrapes, at most every ``min_interval`` seconds (a scan of a busy host costs a
    tenth of a second of CPU or more), never between scrapes."""

    def __init__(self, root: Root, config: Config, min_interval: float = 30.0) -> None:
        self.root = root
        self.config = config
        self.min_interval = min_interval
        self._lock = threading.Lock()  # scrapes may run at once
        self._report: Report | None = None
        self._at = 0.0

    def report(self) -> Report:
        from tpuboot.holders.report import chips_of, gather

        with self._lock:
            now = time.monotonic()
            if self._report is None or now - self._at >= self.min_interval:
                self._report, self._at = gather(self.root, chips_of(self.root, self.config)), now
            return self._report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            report = self.report()
        except Exception as exc:  # deliberately total: a scrape never fails on a bad /proc entry
            log.debug("metrics: holders not scanned: %s", exc)
            yield from holder_families({}, {})
            return
        locks = {path: 1.0 if held else 0.0 for path, held in report.lock_states().items()}
        yield from holder_families(report.holder_counts(), locks)


def watch_holders(root: Root, config: Config) -> None:
    """Serve the holders from scans at scrape time (the daemon), instead of what a one-shot
    `tpuboot who` recorded (its textfile)."""
    target = exported(current())
    target.registry.unregister(target.holders)  # the recorded ones, or a daemon's built before (tests)
    target.holders = cast("Collector", HolderCollector(root, config))
    target.registry.register(target.holders)


def watch_pcie(root: Root, table: DeviceTable) -> None:
    """Export the PCIe health of ``root``'s TPU functions with the current metrics (the daemon)."""
    target = exported(current())
    if target.pcie is not None:  # a daemon built again with the same metrics (tests)
        target.registry.unregister(target.pcie)
    target.pcie = cast("Collector", PcieCollector(root, table))
    target.registry.register(target.pcie)


#: The ``make`` label of GKE's device plugin's runtime metrics: always this.
GKE_MAKE = "cloud-tpu"


class RuntimeExport:
    """libtpu's runtime metrics as the daemon's collector last polled them (tpuboot/runtime/),
    under GKE's names and labels (``duty_cycle``, ``memory_used``, ``memory_total``), so GKE's
    dashboards carry over; read from its snapshot at each scrape, nothing asked of libtpu here."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snapshot()
        duty, used, total = map(gauge, (DUTY_CYCLE, MEMORY_USED, MEMORY_TOTAL))
        up, hang, slice_error = map(gauge, (RUNTIME_UP, RUNTIME_HANG, RUNTIME_SLICE_ERROR))
        for p in s.ports:
            who = [str(p.port), str(p.holder.pid), p.holder.where]
            up.add_metric(who, 0 if p.reading is None else 1)
            if p.reading is None:
                continue
            hang.add_metric(who, 1 if p.reading.hang else 0)
            slice_error.add_metric(who, 0 if p.reading.slice_error is None else 1)
            for d in p.reading.devices:
                labels = [
                    GKE_MAKE,
                    f"{s.host}-{d.device}",
                    s.model,
                    s.topology,
                    str(p.holder.pid),
                    p.holder.where,
                ]
                for family, value in ((duty, d.duty_cycle), (used, d.memory_used), (total, d.memory_total)):
                    if value is not None:
                        family.add_metric(labels, value)
        yield from (duty, used, total, up, hang, slice_error)


def watch_runtime(snapshot: Callable[[], Snapshot]) -> None:
    """Export libtpu's runtime metrics from ``snapshot`` (the daemon's collector) with the
    current metrics."""
    target = exported(current())
    if target.runtime is not None:  # a daemon built again with the same metrics (tests)
        target.registry.unregister(target.runtime)
    target.runtime = cast("Collector", RuntimeExport(snapshot))
    target.registry.register(target.runtime)


def _server_class(address: str, port: int) -> tuple[type[MetricsServer], str]:
    """A server class whose address family suits ``address`` (an IPv6 literal needs AF_INET6),
    and the address to bind; raises OSError (socket.gaierror) for an unresolvable name."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(MetricsServer):
        address_family = family

    return Server, str(sockaddr[0])


def serve(config: MetricsConfig) -> MetricsServer | None:
    """Serve the current metrics on ``config.address:port`` in a daemon thread; None if disabled
    or the port cannot be had (one warning line: the daemon runs on without metrics).
    ``server.server_port`` is the port (for port 0); ``server.shutdown()`` stops it. What a client
    can make it hold is bounded (tpuboot/metrics_server.py)."""
    if not config.enabled:
        return None
    try:
        server_class, addr = _server_class(config.address, config.port)
        server = make_server(
            addr, config.port, make_wsgi_app(registry_of(current())), server_class, handler_class=QuietHandler
        )
    except OSError as exc:
        log.warning(
            "metrics: cannot listen on %s:%d (%s); running without metrics (set metrics.port)",
            config.address,
            config.port,
            exc.strerror or exc,
        )
        return None
    server.start()
    log.info("metrics: serving http://%s:%d/metrics", config.address, server.server_port)
    return server


def write_textfile(root: Root, config: MetricsConfig) -> str | None:
    """Write the current metrics to ``<textfile_dir>/tpuboot.prom`` atomically, for node_exporter's
    textfile collector; returns the path, None when no directory is configured or on failure (warned)."""
    return _write_textfile(root, config, TEXTFILE_NAME, lambda: exposition(current()))


def _write_textfile(root: Root, config: MetricsConfig, name: str, text: Callable[[], bytes]) -> str | None:
    """``text()`` to ``<textfile_dir>/<name>``, atomically (node_exporter never reads half a file)."""
    if not config.textfile_dir:
        return None
    path = config.textfile_dir.rstrip("/") + "/" + name
    try:
        write_file(root, path, text(), mode=0o644)
    except Exception as exc:  # a metrics file never fails a command
        log.warning("metrics: %s", exc)
        return None
    return path


@dataclass(frozen=True, eq=False)  # a collector: the registry keys it by identity
class SliceSweep:
    """What the last ``tpuboot slice`` or ``wait-slice`` look found: the peer paths by state (every
    state of :data:`tpuboot.slice.sweep.STATES` present, 0 or more), its FAILs, and when it ended."""

    paths: Mapping[str, int]
    failures: int
    when: float

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield gauges(SLICE_PATHS, [((state,), float(count)) for state, count in self.paths.items()])
        yield gauges(SLICE_FAILURES, [((), self.failures)])
        yield gauges(SLICE_LAST_SWEEP, [((), self.when)])


def slice_exposition(sweep: SliceSweep) -> bytes:
    """The last look at the slice in Prometheus' text format (``tpuboot-slice.prom``)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(cast("Collector", sweep))
    return generate_latest(registry)


def write_slice_textfile(root: Root, config: MetricsConfig, sweep: SliceSweep) -> str | None:
    """The last look at the slice to ``<textfile_dir>/tpuboot-slice.prom``, a file of its own: the
    look is on demand, and another command's ``tpuboot.prom`` must not drop it."""
    return _write_textfile(root, config, SLICE_TEXTFILE_NAME, lambda: slice_exposition(sweep))
