"""What tpuboot counts, recorded in plain Python where it happens; :mod:`tpuboot.metrics_export`
alone imports prometheus_client and shows these in Prometheus' format (served on loopback by the
daemon, written as a node_exporter textfile by the one-shot commands). So the boot path records
its binds, metadata requests and tpu-env without loading prometheus_client, and the daemon's
endpoint starts in a thread of its own that READY never waits for.

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
  the supervised containers (vBar, the telemetry collector); ``tpuboot_container_endpoint_up``
  ``{container}``: 1 while a running agent answers at its endpoint, 0 while it does not (no
  series before the first check of the running container)
- ``tpuboot_chip_holders{chip,state}``: processes holding each chip's nodes open (chip: its base
  address, as the PCIe metrics label it), by process state (running, sleeping, stopped, zombie,
  uninterruptible), from the last `tpuboot who`
- ``tpuboot_libtpu_lock_held{path}``: 1 while a process holds that libtpu lock file, 0 while it
  exists and nobody does
- ``tpuboot_automatic_resets_total{chip,result}``: resets the daemon made (``recovery.automatic``)
  of a chip that fell off the bus or logged a fatal error, by result (recovered, failed)
- ``tpuboot_boot_phase_seconds{phase}``: when each phase of this boot ended (tpuboot/bootbudget.py)
- in ``tpuboot-slice.prom``, the last look of `tpuboot slice` or `wait-slice`:
  ``tpuboot_slice_paths{state}`` (peer paths by state: open, refused, dropped, unreachable,
  error), ``tpuboot_slice_failures`` (its FAILs) and ``tpuboot_slice_last_sweep_timestamp_seconds``
- ``tpuboot_slice_identity_info{worker,digest}`` 1: this worker's index in tpu-env and the digest
  of its slice-wide keys (tpuboot/env/published.py), for a comparison across the slice; no
  series before tpu-env is written
- ``tpuboot_notice{kind}``: 1 while the metadata server warns of the host going away (kind
  maintenance, upcoming, preempted; tpuboot/notices/), 0 while not; and
  ``tpuboot_maintenance_window_start_timestamp_seconds``: when the scheduled maintenance window
  opens (unix seconds; no series while none is scheduled or its start is not known)
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
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, get_args

if TYPE_CHECKING:
    from tpuboot.bootbudget import Phase

log = logging.getLogger("tpuboot.metrics")
T = TypeVar("T")
P = ParamSpec("P")

TEXTFILE_NAME = "tpuboot.prom"
#: The last look of `tpuboot slice` or `wait-slice`, beside the commands' own file.
SLICE_TEXTFILE_NAME = "tpuboot-slice.prom"
#: The ``result`` label of a bind attempt.
BindOutcome = Literal["bound", "already_bound", "failed_transient", "failed"]
BIND_RESULTS: tuple[BindOutcome, ...] = get_args(BindOutcome)
METADATA_OUTCOMES = ("ok", "absent", "refused", "transient")
BIND_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Count:
    """A counter's value and when its series began (Prometheus' ``_created``)."""

    value: float = 0.0
    created: float = field(default_factory=time.time)


@dataclass
class Durations:
    """A histogram's observations: how many fell in each of :data:`BIND_BUCKETS` (the last: above
    them all), their sum, and when the series began."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BIND_BUCKETS) + 1))
    total: float = 0.0
    created: float = field(default_factory=time.time)

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(BIND_BUCKETS) if seconds <= bound), len(BIND_BUCKETS))
        self.counts[index] += 1
        self.total += seconds


class Metrics:
    """Every tpuboot metric's current value, for one process (or one test). Updates come from any
    thread; :meth:`snapshot` copies them under the same lock, for an exposition."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tpus: dict[tuple[str, str], int] = {}
        # Zeros from the start: rate() needs the series before the first event.
        self.bind_attempts: dict[str, Count] = {result: Count() for result in BIND_RESULTS}
        self.bind_duration: dict[str, Durations] = {}
        self.metadata_requests: dict[str, Count] = {outcome: Count() for outcome in METADATA_OUTCOMES}
        self.tpu_env_updated = 0.0
        self.tpu_env_from_cache = 0.0
        self.container_up: dict[str, float] = {}
        self.container_endpoint_up: dict[str, float] = {}
        self.container_restarts: dict[str, Count] = {}
        self.automatic_resets: dict[tuple[str, str], Count] = {}
        self.chip_holders: dict[tuple[str, str], int] = {}
        self.libtpu_lock_held: dict[str, float] = {}
        self.boot_phase: dict[str, float] = {}
        self.slice_identity: tuple[str, str] | None = None  # (worker, digest) of tpu-env
        self.notice: dict[str, float] = {}
        self.maintenance_window_start: float | None = None

    def set_tpus(self, devices: Iterable[tuple[str, str]]) -> None:
        """(generation, state) of every TPU now; label sets no longer seen drop to 0."""
        counts: dict[tuple[str, str], int] = {}
        for labels in devices:
            counts[labels] = counts.get(labels, 0) + 1
        with self.lock:
            self.tpus = {labels: counts.get(labels, 0) for labels in (*self.tpus, *counts)}

    def set_holders(self, counts: dict[tuple[str, str], int], locks: dict[str, bool]) -> None:
        """Holders per (chip, process state), and each lock file's state
        (:meth:`tpuboot.holders.report.Report.holder_counts`, ``lock_states``); label sets no longer
        seen drop to 0 (a lock file removed since: its series goes)."""
        with self.lock:
            self.chip_holders = {key: counts.get(key, 0) for key in (*self.chip_holders, *counts)}
            self.libtpu_lock_held = {path: 1.0 if held else 0.0 for path, held in locks.items()}

    def snapshot(self) -> Metrics:
        """A copy of every value, taken at one moment."""
        copy = Metrics.__new__(Metrics)
        with self.lock:
            copy.__dict__.update(
                {name: _copied(value) for name, value in self.__dict__.items() if name != "lock"}
            )
        copy.lock = threading.Lock()
        return copy


def _copied(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, Count):
        return Count(value.value, value.created)
    if isinstance(value, Durations):
        return Durations(list(value.counts), value.total, value.created)
    return value


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
    seconds = max(0.0, seconds)
    with _current.lock:
        _current.bind_attempts[result].value += 1
        _current.bind_duration.setdefault(result, Durations()).observe(seconds)


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
def holders(counts: dict[tuple[str, str], int], locks: dict[str, bool]) -> None:
    """What `tpuboot who` found: holders per chip and state, and the libtpu lock files."""
    _current.set_holders(counts, locks)


@_safe
def metadata_request(outcome: str) -> None:
    """One request to the metadata server ended with ``outcome`` (one of METADATA_OUTCOMES)."""
    with _current.lock:
        _current.metadata_requests.setdefault(outcome, Count()).value += 1


@_safe
def tpu_env_updated(from_cache: bool, when: float | None = None) -> None:
    """tpu-env was just written or confirmed, from metadata or (``from_cache``) the local cache."""
    with _current.lock:
        _current.tpu_env_updated = time.time() if when is None else when
        _current.tpu_env_from_cache = 1.0 if from_cache else 0.0


@_safe
def container_up(container: str, up: bool) -> None:
    """The supervised ``container`` is running (``up``) or not."""
    with _current.lock:
        _current.container_up[container] = 1.0 if up else 0.0


@_safe
def container_endpoint_up(container: str, up: bool | None) -> None:
    """The running ``container`` answered at its endpoint (``up``), did not, or (None) is no longer
    checked: stopped or restarted, so its series goes until its successor is checked."""
    with _current.lock:
        if up is None:
            _current.container_endpoint_up.pop(container, None)
        else:
            _current.container_endpoint_up[container] = 1.0 if up else 0.0


@_safe
def container_restarted(container: str) -> None:
    """tpuboot restarted the supervised ``container``."""
    with _current.lock:
        _current.container_restarts.setdefault(container, Count()).value += 1


@_safe
def automatic_reset(chip: str, result: str) -> None:
    """The daemon climbed the reset ladder for ``chip`` (its base address): ``result`` recovered or failed."""
    with _current.lock:
        _current.automatic_resets.setdefault((chip, result), Count()).value += 1


@_safe
def boot_phases(phases: Iterable[Phase]) -> None:
    """The boot budget's phases; the binds as one phase, when the last of them ended."""
    ends: dict[str, float] = {}
    for phase in phases:
        ends[phase.name] = max(ends.get(phase.name, 0.0), phase.seconds)
    with _current.lock:
        _current.boot_phase.update(ends)


@_safe
def slice_identity(mine: tuple[int | None, str] | None) -> None:
    """What tpu-env as written now publishes (:class:`tpuboot.env.published.Published`): this
    worker's index (None when tpu-env has none) and its slice-wide digest; None when tpu-env holds
    no values (the series goes)."""
    with _current.lock:
        _current.slice_identity = None if mine is None else ("" if mine[0] is None else str(mine[0]), mine[1])


@_safe
def notice(kind: str, active: bool, window_start: float | None = None) -> None:
    """The notice of ``kind`` is ``active`` or not; an upcoming one's window start (unix seconds)."""
    with _current.lock:
        _current.notice[kind] = 1.0 if active else 0.0
        if kind == "upcoming":
            _current.maintenance_window_start = window_start if active else None
