"""tpuboot's metrics in Prometheus' format: the one module that imports prometheus_client.

A registry per :class:`~tpuboot.metrics.Metrics` (never the global one) shows its recorded values,
plus what is read when Prometheus scrapes (:class:`PcieCollector`, :class:`HolderCollector`); the
daemon serves it on loopback (:func:`serve`, from the endpoint's own thread: tpuboot/daemon.py) and
the one-shot commands write it as a node_exporter textfile (:func:`write_textfile`; the last look at
the slice in a file of its own, :func:`write_slice_textfile`). The names and
what each means: tpuboot/metrics.py.
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

from tpuboot import __version__
from tpuboot.atomicfile import write_file
from tpuboot.config import Config, MetricsConfig
from tpuboot.devices.chips import base_address
from tpuboot.devices.health import AER_FILES, read_healths
from tpuboot.devices.pci import tpu_functions
from tpuboot.devices.table import DeviceTable
from tpuboot.metrics import (
    BIND_BUCKETS,
    SLICE_TEXTFILE_NAME,
    TEXTFILE_NAME,
    Count,
    Metrics,
    current,
)
from tpuboot.metrics_server import MetricsServer, QuietHandler
from tpuboot.paths import Root

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from tpuboot.holders.report import Report
    from tpuboot.runtime.collector import Snapshot

log = logging.getLogger("tpuboot.metrics")

Family = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily | InfoMetricFamily


class Recorded:
    """The values a :class:`~tpuboot.metrics.Metrics` recorded, as metric families, read at each
    scrape from one snapshot; the holders apart (:class:`RecordedHolders`)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Family]:
        m = self.metrics.snapshot()
        yield InfoMetricFamily("tpuboot_build", "tpuboot build information.", value={"version": __version__})
        yield gauges(
            "tpuboot_tpus", "TPUs seen, by generation and state.", ["generation", "state"], m.tpus.items()
        )
        yield counters(
            "tpuboot_bind_attempts",
            "Attempts to bind a TPU to vfio-pci, by result.",
            "result",
            m.bind_attempts,
        )
        durations = HistogramMetricFamily(
            "tpuboot_bind_duration_seconds", "Time one bind attempt took, by result.", labels=["result"]
        )
        bounds = [str(float(bound)) for bound in BIND_BUCKETS] + ["+Inf"]  # as prometheus_client writes le
        for result, seen in m.bind_duration.items():
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, seen.counts, strict=True):
                cumulative += count
                buckets.append((bound, float(cumulative)))
            durations.add_metric([result], buckets, seen.total)
        yield durations
        yield counters(
            "tpuboot_metadata_requests",
            "HTTP requests to the metadata server, by outcome.",
            "outcome",
            m.metadata_requests,
        )
        yield GaugeMetricFamily(
            "tpuboot_tpu_env_last_update_timestamp_seconds",
            "When tpu-env was last written or confirmed (unix seconds).",
            value=m.tpu_env_updated,
        )
        yield GaugeMetricFamily(
            "tpuboot_tpu_env_from_cache",
            "1 if the last tpu-env update came from the local cache, not the metadata server.",
            value=m.tpu_env_from_cache,
        )
        up = [((container,), value) for container, value in m.container_up.items()]
        yield gauges("tpuboot_container_up", "1 while the supervised container runs.", ["container"], up)
        answering = [((container,), value) for container, value in m.container_endpoint_up.items()]
        yield gauges(
            "tpuboot_container_endpoint_up",
            "1 while the running agent accepts connections at its endpoint (vbar.endpoint), 0 while not.",
            ["container"],
            answering,
        )
        yield counters(
            "tpuboot_container_restarts",
            "Restarts of a supervised container by tpuboot.",
            "container",
            m.container_restarts,
        )
        resets = CounterMetricFamily(
            "tpuboot_automatic_resets",
            "Resets the daemon made of a wedged chip (recovery.automatic), by result.",
            labels=["chip", "result"],
        )
        for (chip, result), counted in m.automatic_resets.items():
            resets.add_metric([chip, result], counted.value, created=counted.created)
        yield resets
        identity = InfoMetricFamily(
            "tpuboot_slice_identity",
            "This worker's index in tpu-env and the digest of tpu-env's slice-wide keys (doc/slice.md).",
            labels=["worker", "digest"],
        )
        if m.slice_identity is not None:
            identity.add_metric(list(m.slice_identity), {})
        yield identity
        notices = [((kind,), value) for kind, value in m.notice.items()]
        yield gauges(
            "tpuboot_notice",
            "1 while the metadata server warns that the host goes away (maintenance, upcoming, preempted).",
            ["kind"],
            notices,
        )
        window = GaugeMetricFamily(
            "tpuboot_maintenance_window_start_timestamp_seconds",
            "When the scheduled host maintenance window opens (unix seconds); no sample while none is.",
            labels=[],
        )
        if m.maintenance_window_start is not None:
            window.add_metric([], m.maintenance_window_start)
        yield window
        phases = [((phase,), seconds) for phase, seconds in m.boot_phase.items()]
        yield gauges(
            "tpuboot_boot_phase_seconds",
            "When each phase of this boot ended, in seconds since tpuboot started (bind: the last TPU's).",
            ["phase"],
            phases,
        )


def counters(name: str, doc: str, label: str, counts: Mapping[str, Count]) -> CounterMetricFamily:
    """A counter family with one label; each series with its ``_created``."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, counted in counts.items():
        family.add_metric([value], counted.value, created=counted.created)
    return family


def gauges(
    name: str, doc: str, labels: list[str], series: Iterable[tuple[Sequence[str], float]]
) -> GaugeMetricFamily:
    """A gauge family: one series per (label values, value)."""
    family = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in series:
        family.add_metric(list(key), value)
    return family


class RecordedHolders:
    """What a one-shot `tpuboot who` recorded of the holders (its textfile); the daemon shows its
    own scans instead (:class:`HolderCollector`)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m = self.metrics.snapshot()
        yield from holder_families(m.chip_holders, m.libtpu_lock_held)


def holder_families(
    holders: Mapping[tuple[str, str], int], locks: Mapping[str, float]
) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """The holder gauges, from a one-shot `tpuboot who` or the daemon's scan."""
    chips = gauges(
        "tpuboot_chip_holders",
        "Processes holding a TPU chip's device nodes open, by chip and process state.",
        ["chip", "state"],
        holders.items(),
    )
    held = gauges(
        "tpuboot_libtpu_lock_held",
        "1 while a process holds the libtpu lock file, 0 while it exists unheld.",
        ["path"],
        [((path,), value) for path, value in locks.items()],
    )
    return chips, held


@dataclass
class Exported:
    """One Metrics' registry and the collectors the daemon added to it."""

    registry: CollectorRegistry
    holders: Collector  # RecordedHolders, until the daemon's HolderCollector replaces it
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
            registry.register(cast("Collector", Recorded(metrics)))  # the ABC exists from 0.14 only
            holders = cast("Collector", RecordedHolders(metrics))
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
        labels = ["address", "chip"]
        present = GaugeMetricFamily(
            "tpuboot_pcie_present", "1 while the TPU function answers config reads.", labels=labels
        )
        ratio = GaugeMetricFamily(
            "tpuboot_pcie_link_bandwidth_ratio",
            "PCIe link bandwidth now over the most the link can do (1: full).",
            labels=labels,
        )
        width = GaugeMetricFamily(
            "tpuboot_pcie_link_width", "PCIe link lanes, current or max.", labels=[*labels, "link"]
        )
        speed = GaugeMetricFamily(
            "tpuboot_pcie_link_speed_gigatransfers_per_second",
            "PCIe link speed per lane, current or max.",
            labels=[*labels, "link"],
        )
        errors = CounterMetricFamily(
            "tpuboot_pcie_errors", "AER errors since boot, by kind (severity).", labels=[*labels, "kind"]
        )
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


#: GKE's device plugin's labels of duty_cycle, memory_used and memory_total (its ``make``
#: is always this); tpuboot adds the holder where GKE has namespace, pod and container.
GKE_MAKE = "cloud-tpu"
RUNTIME_LABELS = ["make", "accelerator_id", "model", "tpu_topology", "pid", "holder"]


class RuntimeExport:
    """libtpu's runtime metrics as the daemon's collector last polled them (tpuboot/runtime/),
    under GKE's names and labels (``duty_cycle``, ``memory_used``, ``memory_total``), so GKE's
    dashboards carry over; read from its snapshot at each scrape, nothing asked of libtpu here."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snapshot()
        duty = GaugeMetricFamily(
            "duty_cycle", "Percent of time when the TPU was actively processing", labels=RUNTIME_LABELS
        )
        used = GaugeMetricFamily("memory_used", "Allocated TPU memory in bytes", labels=RUNTIME_LABELS)
        total = GaugeMetricFamily(
            "memory_total", "Total memory available on the TPU in bytes", labels=RUNTIME_LABELS
        )
        port_labels = ["port", "pid", "holder"]
        up = GaugeMetricFamily(
            "tpuboot_runtime_metrics_up",
            "1 when the chip holder's libtpu answered the last poll of its metric port, 0 when not.",
            labels=port_labels,
        )
        hang = GaugeMetricFamily(
            "tpuboot_runtime_hang_detected",
            "1 while libtpu's megascale error gauge reports HANG_DETECTED (GKE: MegascaleHangDetected).",
            labels=port_labels,
        )
        slice_error = GaugeMetricFamily(
            "tpuboot_runtime_slice_error_detected",
            "1 while libtpu's slice error gauge is on (GKE: SliceErrorDetected).",
            labels=port_labels,
        )
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
        yield gauges(
            "tpuboot_slice_paths",
            "Paths to the slice's peers in the last sweep (tpuboot slice), by state.",
            ["state"],
            [((state,), float(count)) for state, count in self.paths.items()],
        )
        yield GaugeMetricFamily(
            "tpuboot_slice_failures",
            "Findings of the last tpuboot slice look that failed.",
            value=self.failures,
        )
        yield GaugeMetricFamily(
            "tpuboot_slice_last_sweep_timestamp_seconds",
            "When the last tpuboot slice look ended (unix seconds).",
            value=self.when,
        )


def slice_exposition(sweep: SliceSweep) -> bytes:
    """The last look at the slice in Prometheus' text format (``tpuboot-slice.prom``)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(cast("Collector", sweep))
    return generate_latest(registry)


def write_slice_textfile(root: Root, config: MetricsConfig, sweep: SliceSweep) -> str | None:
    """The last look at the slice to ``<textfile_dir>/tpuboot-slice.prom``, a file of its own: the
    look is on demand, and another command's ``tpuboot.prom`` must not drop it."""
    return _write_textfile(root, config, SLICE_TEXTFILE_NAME, lambda: slice_exposition(sweep))
