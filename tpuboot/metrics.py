"""Prometheus metrics: one dedicated registry, served on loopback by the daemon, written as a
node_exporter textfile by the one-shot commands.

Names follow Prometheus conventions (``tpuboot_`` prefix, base units, ``_total`` counters,
``_seconds`` durations):

- ``tpuboot_build_info{version}`` 1
- ``tpuboot_tpus{generation,state}``: TPUs the daemon manages (state pending, bound, failed);
  in a textfile, what `tpuboot status` sees (state bound or unbound)
- ``tpuboot_bind_attempts_total{result}`` and ``tpuboot_bind_duration_seconds{result}``
  (result: bound, already_bound, failed_transient, failed)
- ``tpuboot_metadata_requests_total{outcome}`` (ok, absent, refused, transient)
- ``tpuboot_tpu_env_last_update_timestamp_seconds`` (unix seconds of the last write or
  confirmation of tpu-env) and ``tpuboot_tpu_env_from_cache`` (1: that came from the cache)
- ``tpuboot_container_up{container}`` and ``tpuboot_container_restarts_total{container}`` for
  the supervised containers (vBar, the telemetry collector)
- ``tpuboot_chip_holders{chip,state}``: processes holding each chip's nodes open (chip: its base
  address, as the PCIe metrics label it), by process state (running, sleeping, stopped, zombie,
  uninterruptible), from the last `tpuboot who`
- ``tpuboot_libtpu_lock_held{path}``: 1 while a process holds that libtpu lock file, 0 while it
  exists and nobody does
- ``tpuboot_boot_phase_seconds{phase}``: when each phase of this boot ended (tpuboot/bootbudget.py)
- PCIe health of every TPU function, read from sysfs at scrape time (:class:`PcieCollector`):
  ``tpuboot_pcie_present{address,chip}`` (0: fell off the bus), ``tpuboot_pcie_link_bandwidth_ratio``
  (current over maximum), ``tpuboot_pcie_link_width{link}`` and
  ``tpuboot_pcie_link_speed_gigatransfers_per_second{link}`` (link current or max), and
  ``tpuboot_pcie_errors_total{kind}`` (AER counters since boot by severity: correctable, nonfatal,
  fatal; not named ``severity``, which alert rules set)

Every update goes through a function of this module that never raises: metrics must never
break the daemon. :func:`use` swaps in a fresh :class:`Metrics` (tests, the one-shot CLI).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, cast, get_args
from wsgiref.simple_server import make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tpuboot import __version__
from tpuboot.atomicfile import write_file
from tpuboot.config import Config, MetricsConfig
from tpuboot.devices.chips import base_address
from tpuboot.devices.health import AER_FILES, load_baselines, read_health
from tpuboot.devices.pci import PciFunction, list_addresses
from tpuboot.devices.table import DeviceTable
from tpuboot.metrics_server import MetricsServer, QuietHandler
from tpuboot.paths import Root

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from tpuboot.bootbudget import Phase
    from tpuboot.holders.report import Report

log = logging.getLogger("tpuboot.metrics")
T = TypeVar("T")
P = ParamSpec("P")

TEXTFILE_NAME = "tpuboot.prom"
#: The ``result`` label of a bind attempt.
BindOutcome = Literal["bound", "already_bound", "failed_transient", "failed"]
BIND_RESULTS: tuple[BindOutcome, ...] = get_args(BindOutcome)
METADATA_OUTCOMES = ("ok", "absent", "refused", "transient")
BIND_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Every tpuboot metric, in its own CollectorRegistry (never the global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.build = Info("tpuboot_build", "tpuboot build information.", registry=reg)
        self.build.info({"version": __version__})
        self.tpus = Gauge(
            "tpuboot_tpus", "TPUs seen, by generation and state.", ["generation", "state"], registry=reg
        )
        self.bind_attempts = Counter(
            "tpuboot_bind_attempts",
            "Attempts to bind a TPU to vfio-pci, by result.",
            ["result"],
            registry=reg,
        )
        self.bind_duration = Histogram(
            "tpuboot_bind_duration_seconds",
            "Time one bind attempt took, by result.",
            ["result"],
            buckets=BIND_BUCKETS,
            registry=reg,
        )
        self.metadata_requests = Counter(
            "tpuboot_metadata_requests",
            "HTTP requests to the metadata server, by outcome.",
            ["outcome"],
            registry=reg,
        )
        self.tpu_env_updated = Gauge(
            "tpuboot_tpu_env_last_update_timestamp_seconds",
            "When tpu-env was last written or confirmed (unix seconds).",
            registry=reg,
        )
        self.tpu_env_from_cache = Gauge(
            "tpuboot_tpu_env_from_cache",
            "1 if the last tpu-env update came from the local cache, not the metadata server.",
            registry=reg,
        )
        self.container_up = Gauge(
            "tpuboot_container_up", "1 while the supervised container runs.", ["container"], registry=reg
        )
        self.container_restarts = Counter(
            "tpuboot_container_restarts",
            "Restarts of a supervised container by tpuboot.",
            ["container"],
            registry=reg,
        )
        self.chip_holders = Gauge(
            "tpuboot_chip_holders",
            "Processes holding a TPU chip's device nodes open, by chip and process state.",
            ["chip", "state"],
            registry=reg,
        )
        self.libtpu_lock_held = Gauge(
            "tpuboot_libtpu_lock_held",
            "1 while a process holds the libtpu lock file, 0 while it exists unheld.",
            ["path"],
            registry=reg,
        )
        self._holder_labels: set[tuple[str, str]] = set()
        self._lock_labels: set[str] = set()
        for result in BIND_RESULTS:  # zeros from the start: rate() needs the series before the event
            self.bind_attempts.labels(result)
        for outcome in METADATA_OUTCOMES:
            self.metadata_requests.labels(outcome)
        self._tpu_labels: set[tuple[str, str]] = set()
        self.boot_phase = Gauge(
            "tpuboot_boot_phase_seconds",
            "When each phase of this boot ended, in seconds since tpuboot started (bind: the last TPU's).",
            ["phase"],
            registry=reg,
        )
        self.pcie: Collector | None = None  # watch_pcie's collector, once the daemon has one
        self.holders_collector: Collector | None = None  # watch_holders's

    def set_tpus(self, devices: Iterable[tuple[str, str]]) -> None:
        """(generation, state) of every TPU now; label sets no longer seen drop to 0."""
        counts: dict[tuple[str, str], int] = {}
        for labels in devices:
            counts[labels] = counts.get(labels, 0) + 1
        for labels in self._tpu_labels | set(counts):
            self.tpus.labels(*labels).set(counts.get(labels, 0))
        self._tpu_labels |= set(counts)

    def set_holders(self, report: Report) -> None:
        """Holders per chip and state, and each lock file; label sets no longer seen drop to 0
        (a lock file removed since: its series goes)."""
        counts = holder_counts(report)
        for labels in self._holder_labels | set(counts):
            self.chip_holders.labels(*labels).set(counts.get(labels, 0))
        self._holder_labels |= set(counts)
        locks = lock_states(report)
        for path in self._lock_labels - set(locks):
            self.libtpu_lock_held.remove(path)
        for path, held in locks.items():
            self.libtpu_lock_held.labels(path).set(1 if held else 0)
        self._lock_labels = set(locks)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def holder_counts(report: Report) -> dict[tuple[str, str], int]:
    """(chip's base address, process state): holders; every chip has its ("running") series."""
    counts: dict[tuple[str, str], int] = {}
    for c in report.chips:
        counts.setdefault((c.chip.address, "running"), 0)
        for h in c.holders:
            key = (c.chip.address, h.process.state)
            counts[key] = counts.get(key, 0) + 1
    return counts


def lock_states(report: Report) -> dict[str, bool]:
    """Each libtpu lock file and whether a process holds it."""
    return {lock.path: lock.held for lock in report.locks}


_current = Metrics()


def current() -> Metrics:
    return _current


@contextlib.contextmanager
def use(metrics: Metrics) -> Iterator[Metrics]:
    """Make ``metrics`` the one every update goes to, within the block."""
    global _current
    previous, _current = _current, metrics
    try:
        yield metrics
    finally:
        _current = previous


def _safe(func: Callable[P, None]) -> Callable[P, None]:
    """Metrics never break the caller: any exception is logged at debug level and dropped."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            func(*args, **kwargs)
        except Exception as exc:  # deliberately total
            log.debug("metric update %s failed: %s", func.__name__, exc)

    return wrapper


@_safe
def bind_attempt(result: BindOutcome, seconds: float) -> None:
    """One bind attempt ended with ``result`` (one of BIND_RESULTS) after ``seconds``."""
    _current.bind_attempts.labels(result).inc()
    _current.bind_duration.labels(result).observe(max(0.0, seconds))


def bind_result(outcome: object) -> BindOutcome:
    """The ``result`` label for a bind attempt that returned or raised ``outcome``."""
    if isinstance(outcome, BaseException):
        return "failed_transient" if getattr(outcome, "transient", False) else "failed"
    return "bound" if getattr(outcome, "changed", True) else "already_bound"


def timed_bind(bind: Callable[..., T], address: str, **kwargs: Any) -> T:
    """``bind(address, **kwargs)``, counted and timed (the one-shot `tpuboot bind`)."""
    started = time.monotonic()
    try:
        result = bind(address, **kwargs)
    except Exception as exc:
        bind_attempt(bind_result(exc), time.monotonic() - started)
        raise
    bind_attempt(bind_result(result), time.monotonic() - started)
    return result


@_safe
def tpus(devices: Iterable[tuple[str, str]]) -> None:
    """(generation, state) of every TPU now."""
    _current.set_tpus(list(devices))


@_safe
def holders(report: Report) -> None:
    """What `tpuboot who` found: holders per chip and state, and the libtpu lock files."""
    _current.set_holders(report)


@_safe
def metadata_request(outcome: str) -> None:
    """One request to the metadata server ended with ``outcome`` (one of METADATA_OUTCOMES)."""
    _current.metadata_requests.labels(outcome).inc()


@_safe
def tpu_env_updated(from_cache: bool, when: float | None = None) -> None:
    """tpu-env was just written or confirmed, from metadata or (``from_cache``) the local cache."""
    _current.tpu_env_updated.set(time.time() if when is None else when)
    _current.tpu_env_from_cache.set(1 if from_cache else 0)


@_safe
def container_up(container: str, up: bool) -> None:
    """The supervised ``container`` is running (``up``) or not."""
    _current.container_up.labels(container).set(1 if up else 0)


@_safe
def container_restarted(container: str) -> None:
    """tpuboot restarted the supervised ``container``."""
    _current.container_restarts.labels(container).inc()


@_safe
def boot_phases(phases: Iterable[Phase]) -> None:
    """The boot budget's phases; the binds as one phase, when the last of them ended."""
    ends: dict[str, float] = {}
    for phase in phases:
        ends[phase.name] = max(ends.get(phase.name, 0.0), phase.seconds)
    for name, seconds in ends.items():
        _current.boot_phase.labels(name).set(seconds)


class PcieCollector:
    """The PCIe health of every TPU function, read from sysfs when Prometheus scrapes: nothing is
    sampled between scrapes (an idle daemon stays asleep) and nothing goes stale."""

    def __init__(self, root: Root, table: DeviceTable) -> None:
        self.root = root
        self.table = table

    def _tpu_addresses(self) -> list[str]:
        found = []
        for address in list_addresses(self.root):
            try:
                if self.table.classify(PciFunction(self.root, address).ids()) is not None:
                    found.append(address)
            except OSError:  # removed while we looked, or unreadable: not vouched for here
                continue
        return found

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
        baselines = load_baselines(self.root)
        for address in self._tpu_addresses():
            health = read_health(self.root, address, baselines)
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
        chips = GaugeMetricFamily(
            "tpuboot_chip_holders",
            "Processes holding a TPU chip's device nodes open, by chip and process state.",
            labels=["chip", "state"],
        )
        locks = GaugeMetricFamily(
            "tpuboot_libtpu_lock_held",
            "1 while a process holds the libtpu lock file, 0 while it exists unheld.",
            labels=["path"],
        )
        try:
            report = self.report()
        except Exception as exc:  # deliberately total: a scrape never fails on a bad /proc entry
            log.debug("metrics: holders not scanned: %s", exc)
            yield from (chips, locks)
            return
        for (chip, state), count in holder_counts(report).items():
            chips.add_metric([chip, state], count)
        for path, held in lock_states(report).items():
            locks.add_metric([path], 1 if held else 0)
        yield from (chips, locks)


def watch_holders(root: Root, config: Config) -> None:
    """Serve the holders from scans at scrape time (the daemon), instead of what a one-shot
    `tpuboot who` set (its textfile)."""
    for gauge in (_current.chip_holders, _current.libtpu_lock_held):
        with contextlib.suppress(KeyError):  # watched already: a daemon built again (tests)
            _current.registry.unregister(gauge)
    if _current.holders_collector is not None:
        _current.registry.unregister(_current.holders_collector)
    collector = cast("Collector", HolderCollector(root, config))
    _current.registry.register(collector)
    _current.holders_collector = collector


def watch_pcie(root: Root, table: DeviceTable) -> None:
    """Export the PCIe health of ``root``'s TPU functions with the current metrics (the daemon)."""
    collector = cast("Collector", PcieCollector(root, table))  # the ABC exists from 0.14 only
    if _current.pcie is not None:  # a daemon built again with the same metrics (tests)
        _current.registry.unregister(_current.pcie)
    _current.registry.register(collector)
    _current.pcie = collector


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
            addr, config.port, make_wsgi_app(_current.registry), server_class, handler_class=QuietHandler
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
    if not config.textfile_dir:
        return None
    path = config.textfile_dir.rstrip("/") + "/" + TEXTFILE_NAME
    try:
        write_file(root, path, _current.exposition(), mode=0o644)
    except Exception as exc:  # a metrics file never fails a command
        log.warning("metrics: %s", exc)
        return None
    return path
