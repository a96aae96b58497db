"""Where a boot's time goes: each start-up phase of `tpuboot run`, timed from the process's start.

A TPU VM that becomes usable late is diagnosed on the VM, without a benchmark: the daemon marks
each phase as it ends (udev monitor open, coldplug enumeration, each bind, the metadata server's
first answer, tpu-env written, /etc/environment, READY, vBar running), logs them in one structured
journal line at READY, exports them as ``tpuboot_boot_phase_seconds``, and keeps them in
``/run/tpuboot/boot.json`` for ``tpuboot status --boot``. vBar's first run is always after READY:
the containers are among the parts the daemon starts only once READY=1 went out
(tpuboot/daemon.py), so the journal line never has it, and the record and the metric gain it
when it comes (tpuboot/derived.py's :class:`~tpuboot.derived.VbarMark`).

Times are seconds since the process started (its start time in ``/proc/self/stat``, so the
interpreter's own start-up counts too), on the kernel's boot-time clock, which also says how long
after the kernel's start the unit began.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpuboot.atomicfile import FileReadError, FileWriteError, read_file, write_file
from tpuboot.component import Part
from tpuboot.errors import shown
from tpuboot.kernelfiles import start_ticks
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.bootbudget")

BUDGET_PATH = "/run/tpuboot/boot.json"
MONITOR_OPEN = "monitor-open"
COLDPLUG = "coldplug-enumerated"
BIND = "bind"  # one per TPU: "bind 0000:00:04.0"
METADATA = "metadata-answered"  # tpu-env's first answer (a value, or 404: not set)
TPU_ENV = "tpu-env-written"
ENVIRONMENT = "etc-environment"
READY = "ready"
VBAR = "vbar-running"
#: The phases of every boot, in the order they are shown (binds stand between coldplug and READY).
PHASES = (MONITOR_OPEN, COLDPLUG, BIND, METADATA, TPU_ENV, ENVIRONMENT, READY, VBAR)
#: What a phase's name and detail may be in the record (a later version may add phases).
_NAME = re.compile(r"[a-z][a-z-]{0,39}")
_DETAIL = re.compile(r"[ -~]{0,200}")  # printable ASCII: a PCI address, a few words
_YEAR = 366 * 86400.0


def boottime() -> float:
    """Now on the boot-time clock (the one /proc/self/stat's start time counts on)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_start(root: Root) -> float | None:
    """When this process started, in seconds of the boot-time clock; None if /proc cannot say."""
    ticks = start_ticks(root, "self")
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Phase:
    name: str  # one of PHASES ("bind" with the TPU's address as ``detail``)
    seconds: float  # since the process started
    detail: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} {self.detail}" if self.detail else self.name


class Budget:
    """The phases marked so far; thread-safe (the env thread and the containers mark too)."""

    def __init__(self, root: Root, clock: Callable[[], float] = boottime) -> None:
        self.root = root
        self.clock = clock
        now = clock()
        start = process_start(root)
        # A start after now (another clock) or none at all: count from this object's birth.
        self.origin: float = start if start is not None and start <= now else now
        self.started_after_boot: float | None = start if start is not None and start <= now else None
        self._lock = threading.Lock()
        self._phases: dict[tuple[str, str], Phase] = {}

    def mark(self, name: str, detail: str = "", at: float | None = None) -> None:
        """Phase ``name`` ended now (or ``at``, a :func:`boottime` reading); only its first end
        counts (a bind retried later is not boot)."""
        seconds = max(0.0, (self.clock() if at is None else at) - self.origin)
        with self._lock:
            if name == BIND and (READY, "") in self._phases:
                return  # a TPU hot-added after READY: not part of the boot
            self._phases.setdefault((name, detail), Phase(name, seconds, detail))

    def phases(self) -> list[Phase]:
        with self._lock:
            found = list(self._phases.values())
        return sorted(found, key=lambda p: (p.seconds, PHASES.index(p.name) if p.name in PHASES else 99))

    def has(self, name: str) -> bool:
        with self._lock:
            return any(key[0] == name for key in self._phases)

    def as_dict(self) -> dict[str, object]:
        return {
            "started_after_boot_seconds": self.started_after_boot,
            "phases": [
                {"phase": p.name, "detail": p.detail, "seconds": round(p.seconds, 6)} for p in self.phases()
            ],
        }

    def journal_fields(self) -> dict[str, str]:
        """One field per phase (``TPUBOOT_BOOT_READY=2.412``), the binds in one field."""
        fields: dict[str, str] = {}
        binds = []
        for p in self.phases():
            if p.name == BIND:
                binds.append(f"{p.detail}={p.seconds:.3f}")
            else:
                fields[f"TPUBOOT_BOOT_{p.name.upper().replace('-', '_')}"] = f"{p.seconds:.3f}"
        if binds:
            fields["TPUBOOT_BOOT_BINDS"] = " ".join(binds)
        if self.started_after_boot is not None:
            fields["TPUBOOT_BOOT_STARTED_AFTER_KERNEL"] = f"{self.started_after_boot:.3f}"
        return fields

    def summary(self) -> str:
        """The journal line's text: each phase with its time, the binds as a range."""
        parts = []
        binds = [p.seconds for p in self.phases() if p.name == BIND]
        for p in self.phases():
            if p.name != BIND:
                parts.append(f"{p.name} {p.seconds:.2f} s")
            elif p.seconds == binds[0]:
                shown = f"{binds[0]:.2f} s" if len(binds) == 1 else f"{binds[0]:.2f}-{binds[-1]:.2f} s"
                parts.append(f"{len(binds)} bind{'s' if len(binds) > 1 else ''} {shown}")
        after = (
            ""
            if self.started_after_boot is None
            else f" (started {self.started_after_boot:.2f} s after the kernel)"
        )
        return "boot budget: " + ", ".join(parts) + after

    def save(self) -> None:
        """Write the phases for `tpuboot status --boot` (not on the daemon's loop: a file write)."""
        try:
            write_file(self.root, BUDGET_PATH, json.dumps(self.as_dict(), indent=1).encode(), mode=0o644)
        except FileWriteError as exc:
            log.warning("boot budget: %s", exc)


class BootBudget(Part):
    """The daemon's marks in the budget (a boot part: READY's is READY's own): at READY its mark and
    the journal line; later marks through :meth:`mark` (vBar's first run). Each is published:
    ``show`` (tpuboot/metrics.py's ``boot_phases``, handed in: that module names this one's
    :class:`Phase`) and, through ``submit`` (the pool: a file write), /run/tpuboot/boot.json."""

    name = "boot budget"

    def __init__(
        self,
        budget: Budget,
        submit: Callable[[Callable[[], None]], object],
        show: Callable[[list[Phase]], None],
    ) -> None:
        self.budget = budget
        self.submit = submit
        self.show = show

    def observe(self, ready: bool) -> None:
        if ready and not self.budget.has(READY):
            self.budget.mark(READY)
            log.info("%s", self.budget.summary(), extra=self.budget.journal_fields())
            self._publish()

    def has(self, name: str) -> bool:
        return self.budget.has(name)

    def mark(self, name: str) -> None:
        """On the loop: phase ``name`` ended now (its first end counts), and the budget published."""
        if not self.budget.has(name):
            self.budget.mark(name)
            self._publish()

    def _publish(self) -> None:
        self.show(self.budget.phases())
        self.submit(self.budget.save)


_current: Budget | None = None


def begin(root: Root) -> Budget:
    """The budget of this run of the daemon (its start is the process's)."""
    global _current
    _current = Budget(root)
    return _current


def mark(name: str, detail: str = "") -> None:
    """Mark a phase of the current budget; nothing when no daemon runs (the one-shot commands)."""
    if _current is not None:
        _current.mark(name, detail)


def current() -> Budget | None:
    return _current


def load(root: Root) -> dict[str, object] | None:
    """What the running (or last) daemon wrote, in the shape :meth:`Budget.as_dict` gives; None
    when there is no record. A damaged one (not JSON, another shape, a time that is no number of
    seconds, a name that is no phase's) is a FileReadError, in one line with its fix."""
    raw = read_file(root, BUDGET_PATH)
    if raw is None:
        return None
    try:
        return _record(json.loads(raw))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise FileReadError(
            f"{BUDGET_PATH} is damaged ({why}); the daemon writes it again at READY "
            "(systemctl restart tpuboot)"
        ) from None


def _record(data: object) -> dict[str, object]:
    """``data`` as :meth:`Budget.as_dict` writes it, rebuilt from the checked values; ValueError
    for anything else."""
    if not isinstance(data, dict) or not isinstance(data.get("phases"), list):
        raise ValueError("not a record of phases")
    after = data.get("started_after_boot_seconds")
    if after is not None and not _seconds(after):
        raise ValueError(f"started_after_boot_seconds {shown(after)} is not seconds")
    phases = []
    for phase in data["phases"]:
        if not isinstance(phase, dict):
            raise ValueError(f"phase {shown(phase)} is not an object")
        name, detail, seconds = phase.get("phase"), phase.get("detail", ""), phase.get("seconds")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{shown(name)} is not a phase's name")
        if not isinstance(detail, str) or not _DETAIL.fullmatch(detail):
            raise ValueError(f"the detail {shown(detail)} of {name} is not one tpuboot writes")
        if not _seconds(seconds):
            raise ValueError(f"the time {shown(seconds)} of {name} is not seconds")
        phases.append({"phase": name, "detail": detail, "seconds": seconds})
    return {"started_after_boot_seconds": after, "phases": phases}


def _seconds(value: object) -> bool:
    """A time tpuboot wrote: a number of seconds from 0 to a year (not a bool, NaN or huge)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return 0 <= value <= _YEAR  # NaN compares false; an int before any float()
