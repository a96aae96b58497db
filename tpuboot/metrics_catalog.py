"""Every metric tpuboot exports, declared once: its name, kind, help, labels and unit, as one
:class:`Metric` record here, which the recorders (:mod:`tpuboot.metrics`), the exposition
(:mod:`tpuboot.metrics_export`) and the tests of the docs and the alert rules all read.

A new metric is one :func:`declare` here; one recorded where it happens also gets its update in
tpuboot/metrics.py (the exposition shows every ``recorded`` one as it is), and its line in
doc/monitoring.md and the man page (tests/unit/repo/test_docs.py says which are missing). Plain
Python, no prometheus_client: the boot path imports it with :mod:`tpuboot.metrics`.

Names follow Prometheus' conventions (``tpuboot_`` prefix, base units, ``_total`` counters,
``_seconds`` durations), but for libtpu's runtime metrics, which keep GKE's names and labels so
that its dashboards carry over.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram", "info"]
#: Where a metric's values come from, which says what shows it:
#: ``recorded`` in tpuboot/metrics.py where it happens; ``holders`` recorded by a one-shot
#: `tpuboot who` or scanned by the daemon at each scrape; ``pcie`` read from sysfs at each scrape;
#: ``runtime`` as the daemon's runtime collector last polled libtpu; ``slice`` the last look of
#: `tpuboot slice`, in its own textfile.
Source = Literal["recorded", "holders", "pcie", "runtime", "slice"]

_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
#: What Prometheus' text format adds to a family's name, by kind (prometheus_client's families
#: take the name without it).
_SUFFIX = {"counter": "_total", "info": "_info"}


@dataclass(frozen=True, eq=False)  # one declaration, one record: compared and hashed by identity
class Metric:
    """One metric as Prometheus shows it. ``name`` is its name in the text format, as PromQL and
    the docs write it (a counter's with ``_total``, an info's with ``_info``); ``unit`` the base
    unit its name ends with, if any; ``buckets`` a histogram's upper bounds."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    source: Source = "recorded"
    buckets: tuple[float, ...] = ()

    @property
    def family(self) -> str:
        """The name prometheus_client's metric families take: without the kind's suffix."""
        return self.name[: -len(_SUFFIX[self.kind])] if self.kind in _SUFFIX else self.name

    @property
    def samples(self) -> tuple[str, ...]:
        """The names of its sample lines in the text format (a counter's ``_created`` too)."""
        if self.kind == "histogram":
            return tuple(f"{self.name}_{part}" for part in ("bucket", "sum", "count"))
        if self.kind == "counter":
            return (self.name, f"{self.family}_created")
        return (self.name,)


class Catalog:
    """Metrics in the order of their declaration (the exposition's), each name once."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._samples: set[str] = set()

    def declare(self, metric: Metric) -> Metric:
        """Add ``metric``; a second metric of a name or sample name already declared, or a record
        prometheus_client could not show as it says, is refused (ValueError) at import."""
        problems = []
        if not all(_NAME.match(word) for word in (metric.name, *metric.labels)):
            problems.append("not a Prometheus name")
        suffix = _SUFFIX.get(metric.kind, "")
        if suffix and not metric.name.endswith(suffix):
            problems.append(f"{metric.kind} names end with {suffix}")
        if bool(metric.buckets) != (metric.kind == "histogram"):
            problems.append("a histogram, and only a histogram, has buckets")
        if len(set(metric.labels)) != len(metric.labels):
            problems.append("a label twice")
        names = {metric.name, *metric.samples}
        if names & self._samples:
            problems.append("declared twice")
        if problems:
            raise ValueError(f"metric {metric.name}: {'; '.join(problems)}")
        self._metrics[metric.name] = metric
        self._samples |= names
        return metric

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._metrics.values())

    def of(self, source: Source) -> tuple[Metric, ...]:
        """The metrics whose values come from ``source``, in order."""
        return tuple(metric for metric in self if metric.source == source)


CATALOG = Catalog()
declare = CATALOG.declare

# --- recorded where it happens (tpuboot/metrics.py) ------------------------------------------------

BUILD_INFO = declare(Metric("tpuboot_build_info", "info", "tpuboot build information.", ("version",)))
TPUS = declare(
    # In a textfile, what `tpuboot status` sees (state bound or unbound).
    Metric("tpuboot_tpus", "gauge", "TPUs seen, by generation and state.", ("generation", "state"))
)
BIND_ATTEMPTS = declare(
    Metric(
        "tpuboot_bind_attempts_total",
        "counter",
        "Attempts to bind a TPU to vfio-pci, by result.",
        ("result",),
    )
)
BIND_DURATION = declare(
    Metric(
        "tpuboot_bind_duration_seconds",
        "histogram",
        "Time one bind attempt took, by result.",
        ("result",),
        unit="seconds",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    )
)
METADATA_REQUESTS = declare(
    Metric(
        "tpuboot_metadata_requests_total",
        "counter",
        "HTTP requests to the metadata server, by outcome.",
        ("outcome",),
    )
)
TPU_ENV_LAST_UPDATE = declare(
    Metric(
        "tpuboot_tpu_env_last_update_timestamp_seconds",
        "gauge",
        "When tpu-env was last written or confirmed (unix seconds).",
        unit="seconds",
    )
)
TPU_ENV_FROM_CACHE = declare(
    Metric(
        "tpuboot_tpu_env_from_cache",
        "gauge",
        "1 if the last tpu-env update came from the local cache, not the metadata server.",
    )
)
CONTAINER_UP = declare(
    Metric("tpuboot_container_up", "gauge", "1 while the supervised container runs.", ("container",))
)
CONTAINER_ENDPOINT_UP = declare(
    # No series before the first check of the running container, nor after it stops.
    Metric(
        "tpuboot_container_endpoint_up",
        "gauge",
        "1 while the running agent accepts connections at its endpoint (vbar.endpoint), 0 while not.",
        ("container",),
    )
)
CONTAINER_RESTARTS = declare(
    Metric(
        "tpuboot_container_restarts_total",
        "counter",
        "Restarts of a supervised container by tpuboot.",
        ("container",),
    )
)
AUTOMATIC_RESETS = declare(
    Metric(
        "tpuboot_automatic_resets_total",
        "counter",
        "Resets the daemon made of a wedged chip (recovery.automatic), by result.",
        ("chip", "result"),
    )
)
SLICE_IDENTITY = declare(
    # No series before tpu-env is written (tpuboot/env/published.py).
    Metric(
        "tpuboot_slice_identity_info",
        "info",
        "This worker's index in tpu-env and the digest of tpu-env's slice-wide keys (doc/slice.md).",
        ("worker", "digest"),
    )
)
NOTICE = declare(
    Metric(
        "tpuboot_notice",
        "gauge",
        "1 while the metadata server warns that the host goes away (maintenance, upcoming, preempted).",
        ("kind",),
    )
)
MAINTENANCE_WINDOW_START = declare(
    Metric(
        "tpuboot_maintenance_window_start_timestamp_seconds",
        "gauge",
        "When the scheduled host maintenance window opens (unix seconds); no sample while none is.",
        unit="seconds",
    )
)
BOOT_PHASE = declare(
    Metric(
        "tpuboot_boot_phase_seconds",
        "gauge",
        "When each phase of this boot ended, in seconds since tpuboot started (bind: the last TPU's).",
        ("phase",),
        unit="seconds",
    )
)

# --- the chips' holders: a one-shot `tpuboot who`'s, or the daemon's scan at each scrape ------------

CHIP_HOLDERS = declare(
    # chip: its base address, as the PCIe metrics label it.
    Metric(
        "tpuboot_chip_holders",
        "gauge",
        "Processes holding a TPU chip's device nodes open, by chip and process state.",
        ("chip", "state"),
        source="holders",
    )
)
LIBTPU_LOCK_HELD = declare(
    Metric(
        "tpuboot_libtpu_lock_held",
        "gauge",
        "1 while a process holds the libtpu lock file, 0 while it exists unheld.",
        ("path",),
        source="holders",
    )
)

# --- the PCIe health of every TPU function, read from sysfs at each scrape --------------------------

PCIE_PRESENT = declare(
    Metric(
        "tpuboot_pcie_present",
        "gauge",
        "1 while the TPU function answers config reads.",
        ("address", "chip"),
        source="pcie",
    )
)
PCIE_BANDWIDTH = declare(
    Metric(
        "tpuboot_pcie_link_bandwidth_ratio",
        "gauge",
        "PCIe link bandwidth now over the most the link can do (1: full).",
        ("address", "chip"),
        unit="ratio",
        source="pcie",
    )
)
PCIE_WIDTH = declare(
    Metric(
        "tpuboot_pcie_link_width",
        "gauge",
        "PCIe link lanes, current or max.",
        ("address", "chip", "link"),
        source="pcie",
    )
)
PCIE_SPEED = declare(
    Metric(
        "tpuboot_pcie_link_speed_gigatransfers_per_second",
        "gauge",
        "PCIe link speed per lane, current or max.",
        ("address", "chip", "link"),
        unit="gigatransfers_per_second",
        source="pcie",
    )
)
PCIE_ERRORS = declare(
    # kind, not severity: alert rules set severity.
    Metric(
        "tpuboot_pcie_errors_total",
        "counter",
        "AER errors since boot, by kind (severity).",
        ("address", "chip", "kind"),
        source="pcie",
    )
)

# --- libtpu's runtime metrics, as the daemon last polled them (tpuboot/runtime/) --------------------

#: GKE's device plugin's labels of duty_cycle, memory_used and memory_total; tpuboot adds the
#: holder (pid, holder) where GKE has namespace, pod and container.
RUNTIME_LABELS = ("make", "accelerator_id", "model", "tpu_topology", "pid", "holder")
#: A chip holder's metric port, for tpuboot's own runtime gauges.
PORT_LABELS = ("port", "pid", "holder")

DUTY_CYCLE = declare(
    Metric(
        "duty_cycle",
        "gauge",
        "Percent of time when the TPU was actively processing",
        RUNTIME_LABELS,
        unit="percent",
        source="runtime",
    )
)
MEMORY_USED = declare(
    Metric(
        "memory_used",
        "gauge",
        "Allocated TPU memory in bytes",
        RUNTIME_LABELS,
        unit="bytes",
        source="runtime",
    )
)
MEMORY_TOTAL = declare(
    Metric(
        "memory_total",
        "gauge",
        "Total memory available on the TPU in bytes",
        RUNTIME_LABELS,
        unit="bytes",
        source="runtime",
    )
)
RUNTIME_UP = declare(
    Metric(
        "tpuboot_runtime_metrics_up",
        "gauge",
        "1 when the chip holder's libtpu answered the last poll of its metric port, 0 when not.",
        PORT_LABELS,
        source="runtime",
    )
)
RUNTIME_HANG = declare(
    Metric(
        "tpuboot_runtime_hang_detected",
        "gauge",
        "1 while libtpu's megascale error gauge reports HANG_DETECTED (GKE: MegascaleHangDetected).",
        PORT_LABELS,
        source="runtime",
    )
)
RUNTIME_SLICE_ERROR = declare(
    Metric(
        "tpuboot_runtime_slice_error_detected",
        "gauge",
        "1 while libtpu's slice error gauge is on (GKE: SliceErrorDetected).",
        PORT_LABELS,
        source="runtime",
    )
)

# --- the last look of `tpuboot slice` or `wait-slice`, in tpuboot-slice.prom ---------------------------

SLICE_PATHS = declare(
    # Every state of tpuboot.slice.sweep.STATES, 0 or more.
    Metric(
        "tpuboot_slice_paths",
        "gauge",
        "Paths to the slice's peers in the last sweep (tpuboot slice), by state.",
        ("state",),
        source="slice",
    )
)
SLICE_FAILURES = declare(
    Metric(
        "tpuboot_slice_failures",
        "gauge",
        "Findings of the last tpuboot slice look that failed.",
        source="slice",
    )
)
SLICE_LAST_SWEEP = declare(
    Metric(
        "tpuboot_slice_last_sweep_timestamp_seconds",
        "gauge",
        "When the last tpuboot slice look ended (unix seconds).",
        unit="seconds",
        source="slice",
    )
)
