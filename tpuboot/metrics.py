"""What tpuboot counts, recorded in plain Python where it happens; :mod:`tpuboot.metrics_export`
alone imports prometheus_client and shows these in Prometheus' format (served on loopback by the
daemon, written as a node_exporter textfile by the one-shot commands). So the boot path records
its binds, metadata requests and tpu-env without loading prometheus_client, and the daemon's
endpoint starts in a thread of its own that READY never waits for.

Each metric is declared once, in :mod:`tpuboot.metrics_catalog` (its name, kind, help, labels and
unit); a :class:`Metrics` keeps a series table for each one whose values are recorded here (source
``recorded``, and ``holders`` for a one-shot `tpuboot who`), by label values, and the exposition
shows every table as it is. What each metric means to an operator: doc/monitoring.md.

Every update goes through a function of this module that never raises: metrics must never
break the daemon. :func:`use` swaps in a fresh :class:`Metrics` (tests, the one-shot CLI).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, get_args

from tpuboot import __version__
from tpuboot.metrics_catalog import (
    AUTOMATIC_RESETS,
    BIND_ATTEMPTS,
    BIND_DURATION,
    BOOT_PHASE,
    BUILD_INFO,
    CATALOG,
    CHIP_HOLDERS,
    CONTAINER_ENDPOINT_UP,
    CONTAINER_RESTARTS,
    CONTAINER_UP,
    LIBTPU_LOCK_HELD,
    MAINTENANCE_WINDOW_START,
    METADATA_REQUESTS,
    NOTICE,
    SLICE_IDENTITY,
    TPU_ENV_FROM_CACHE,
    TPU_ENV_LAST_UPDATE,
    TPUS,
    Metric,
)

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
#: A series' label values, in its metric's order of labels.
Labels = tuple[str, ...]


@dataclass
class Count:
    """A counter's value and when its series began (Prometheus' ``_created``)."""

    value: float = 0.0
    created: float = field(default_factory=time.time)


@dataclass
class Durations:
    """A histogram's observations: how many fell in each of its ``bounds`` (the last count: above
    them all), their sum, and when the series began."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if seconds <= bound), len(self.bounds))
        self.counts[index] += 1
        self.total += seconds


class Metrics:
    """Every recorded metric's series now, for one process (or one test): a table per metric of
    :mod:`tpuboot.metrics_catalog` kept here, by its kind. Updates come from any thread;
    :meth:`snapshot` copies them under the same lock, for an exposition."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        kept = CATALOG.of("recorded") + CATALOG.of("holders")
        self.gauges: dict[Metric, dict[Labels, float]] = {m: {} for m in kept if m.kind in ("gauge", "info")}
        self.counters: dict[Metric, dict[Labels, Count]] = {m: {} for m in kept if m.kind == "counter"}
        self.histograms: dict[Metric, dict[Labels, Durations]] = {
            m: {} for m in kept if m.kind == "histogram"
        }
        # Zeros from the start: rate() needs the series before the first event.
        self.counters[BIND_ATTEMPTS].update({(result,): Count() for result in BIND_RESULTS})
        self.counters[METADATA_REQUESTS].update({(outcome,): Count() for outcome in METADATA_OUTCOMES})
        self.gauges[BUILD_INFO][(__version__,)] = 1.0
        self.gauges[TPU_ENV_LAST_UPDATE][()] = 0.0
        self.gauges[TPU_ENV_FROM_CACHE][()] = 0.0

    def series(self, metric: Metric) -> Mapping[Labels, float | Count | Durations]:
        """``metric``'s series now, by label values (a test's view; updates go through this
        module's functions)."""
        tables: dict[Metric, Mapping[Labels, float | Count | Durations]] = {
            **self.gauges,
            **self.counters,
            **self.histograms,
        }
        return tables[metric]

    def set_tpus(self, devices: Iterable[tuple[str, str]]) -> None:
        """(generation, state) of every TPU now; label sets no longer seen drop to 0."""
        counts: dict[Labels, int] = {}
        for labels in devices:
            counts[labels] = counts.get(labels, 0) + 1
        with self.lock:
            self.gauges[TPUS] = {**dict.fromkeys(self.gauges[TPUS], 0), **counts}

    def set_holders(self, counts: dict[tuple[str, str], int], locks: dict[str, bool]) -> None:
        """Holders per (chip, process state), and each lock file's state
        (:meth:`tpuboot.holders.report.Report.holder_counts`, ``lock_states``); label sets no longer
        seen drop to 0 (a lock file removed since: its series goes)."""
        with self.lock:
            now: dict[Labels, int] = {chip_state: count for chip_state, count in counts.items()}
            self.gauges[CHIP_HOLDERS] = {**dict.fromkeys(self.gauges[CHIP_HOLDERS], 0), **now}
            self.gauges[LIBTPU_LOCK_HELD] = {(path,): 1.0 if held else 0.0 for path, held in locks.items()}

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
        return Durations(value.bounds, list(value.counts), value.total, value.created)
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
        _current.counters[BIND_ATTEMPTS][(result,)].value += 1
        durations = _current.histograms[BIND_DURATION]
        durations.setdefault((result,), Durations(BIND_DURATION.buckets)).observe(seconds)


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
        _current.counters[METADATA_REQUESTS].setdefault((outcome,), Count()).value += 1


@_safe
def tpu_env_updated(from_cache: bool, when: float | None = None) -> None:
    """tpu-env was just written or confirmed, from metadata or (``from_cache``) the local cache."""
    with _current.lock:
        _current.gauges[TPU_ENV_LAST_UPDATE][()] = time.time() if when is None else when
        _current.gauges[TPU_ENV_FROM_CACHE][()] = 1.0 if from_cache else 0.0


@_safe
def container_up(container: str, up: bool) -> None:
    """The supervised ``container`` is running (``up``) or not."""
    with _current.lock:
        _current.gauges[CONTAINER_UP][(container,)] = 1.0 if up else 0.0


@_safe
def container_endpoint_up(container: str, up: bool | None) -> None:
    """The running ``container`` answered at its endpoint (``up``), did not, or (None) is no longer
    checked: stopped or restarted, so its series goes until its successor is checked."""
    with _current.lock:
        if up is None:
            _current.gauges[CONTAINER_ENDPOINT_UP].pop((container,), None)
        else:
            _current.gauges[CONTAINER_ENDPOINT_UP][(container,)] = 1.0 if up else 0.0


@_safe
def container_restarted(container: str) -> None:
    """tpuboot restarted the supervised ``container``."""
    with _current.lock:
        _current.counters[CONTAINER_RESTARTS].setdefault((container,), Count()).value += 1


@_safe
def automatic_reset(chip: str, result: str) -> None:
    """The daemon climbed the reset ladder for ``chip`` (its base address): ``result`` recovered or failed."""
    with _current.lock:
        _current.counters[AUTOMATIC_RESETS].setdefault((chip, result), Count()).value += 1


@_safe
def boot_phases(phases: Iterable[Phase]) -> None:
    """The boot budget's phases; the binds as one phase, when the last of them ended."""
    ends: dict[str, float] = {}
    for phase in phases:
        ends[phase.name] = max(ends.get(phase.name, 0.0), phase.seconds)
    with _current.lock:
        _current.gauges[BOOT_PHASE].update({(name,): seconds for name, seconds in ends.items()})


@_safe
def slice_identity(mine: tuple[int | None, str] | None) -> None:
    """What tpu-env as written now publishes (:class:`tpuboot.env.published.Published`): this
    worker's index (None when tpu-env has none) and its slice-wide digest; None when tpu-env holds
    no values (the series goes)."""
    with _current.lock:
        if mine is None:
            _current.gauges[SLICE_IDENTITY] = {}
        else:
            worker = "" if mine[0] is None else str(mine[0])
            _current.gauges[SLICE_IDENTITY] = {(worker, mine[1]): 1.0}


@_safe
def notice(kind: str, active: bool, window_start: float | None = None) -> None:
    """The notice of ``kind`` is ``active`` or not; an upcoming one's window start (unix seconds)."""
    with _current.lock:
        _current.gauges[NOTICE][(kind,)] = 1.0 if active else 0.0
        if kind == "upcoming":
            start = window_start if active else None
            _current.gauges[MAINTENANCE_WINDOW_START] = {} if start is None else {(): start}
