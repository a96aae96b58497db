"""Bringing a wedged chip back: a ladder of ever larger resets, stopping at the first that works.

People reset a wedged accelerator by hand with whatever they find (tt-kmd's secondary bus reset,
edgetpu's remove and rescan, a VM restart). tpuboot climbs the same rungs in order of how much
they disturb, each one on every function of the chip:

1. ``function-reset``: the kernel's own reset (``reset`` in sysfs, which uses the first method
   ``reset_method`` lists: FLR, PM, bus...); absent when the kernel offers none.
2. ``rebind``: unbind from vfio-pci and bind again (the driver's teardown and probe).
3. ``remove-rescan``: the function removed from the kernel and found again by a bus rescan.

After each rung the chip must be back (config space answers), bound to vfio-pci and usable (its
/dev/vfio node there with the configured mode, its group viable); the ladder stops at the first
rung that leaves it so. A chip somebody holds is never reset (the job would lose the device
under it), and a circuit breaker bounds the resets of one chip per hour: a chip that needs more
needs a new host, not another reset.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tpuboot.atomicfile import FileError, FileReadError, open_lock, read_file, write_file
from tpuboot.devices.chips import Chip, ChipFunction, base_address
from tpuboot.devices.health import is_present, load_baselines, read_health, save_baseline
from tpuboot.devices.pci import PCI_DEVICES, PciFunction, is_chip_address
from tpuboot.devices.survey import describe
from tpuboot.devices.table import VFIO_ACCESS
from tpuboot.devices.vfio import VFIO_PCI, Binder
from tpuboot.errors import DeviceError, TpubootError, shown
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.reset")

RESCAN = "/sys/bus/pci/rescan"
#: Where the breaker remembers each chip's resets (root's, survives tpuboot restarts and reboots:
#: a chip reset again and again across boots is the pattern it exists to stop).
BREAKER_PATH = "/var/lib/tpuboot/resets.json"
#: Held (flock) while a ladder climbs: one reset at a time on the host (see :func:`one_at_a_time`).
RESET_LOCK = "/var/lib/tpuboot/resets.lock"
HOUR = 3600.0
_LATEST = 1 << 33
RUNGS = ("function-reset", "rebind", "remove-rescan")
BIND_TRIES = 3


class ResetRefused(TpubootError):
    """A reset that must not be done now: the chip is held, or its breaker is open."""


@dataclass(frozen=True)
class Step:
    """One rung climbed: what was done and whether the chip was back after it."""

    rung: str
    done: str
    back: bool
    problem: str | None = None  # why it is not back (or why the rung could not run)


def chip_to_reset(root: Root, chips: Sequence[Chip], address: str, breaker: Breaker) -> Chip:
    """The chip that has function ``address``: one tpuboot has seen as a TPU. That is a chip of
    ``chips`` (functions present now that the device table calls TPUs), or, for a function sysfs
    no longer lists, one tpuboot's own records hold (:func:`recorded_chips`: it reset that chip;
    a rung may have lost it): a chip of that one function, for which a rescan is the only rung.
    Any other address is refused before anything is written: a typo is no reason to rescan the
    bus, and a chip the kernel removed on its own is somebody's hot remove."""
    for chip in chips:
        if any(fn.address == address for fn in chip.functions):
            if chip.access != VFIO_ACCESS:
                raise DeviceError(
                    f"{address} is a {chip.kind} chip, served by the accel driver: tpuboot resets only "
                    "the chips it binds to vfio-pci"
                )
            return chip
    if PciFunction(root, address).exists():
        raise DeviceError(
            f"{address} is not a TPU; tpuboot never resets another device (it may be the boot disk)"
        )
    if base_address(address) not in recorded_chips(root, breaker):
        raise DeviceError(
            f"{address} is no PCI function here, and tpuboot has no record of a TPU there (it reset "
            "none); check the address (`tpuboot status` lists the TPUs); a chip the kernel removed "
            "on its own comes back with `echo 1 > /sys/bus/pci/rescan`, as root"
        )
    return Chip(
        -1, base_address(address), "TPU (removed)", VFIO_ACCESS, (ChipFunction(address, "", None),), 1
    )


def recorded_chips(root: Root, breaker: Breaker) -> set[str]:
    """The base addresses of chips tpuboot reset: in the breaker's record (the last hour's,
    across reboots) or in the AER baselines (a reset that brought it back, this boot). Only root
    writes either; a damaged one counts for nothing."""
    return set(breaker.chips()) | {base_address(a) for a in load_baselines(root)}


#: The end of a refusal for want of root.
NEEDS_ROOT = "a reset needs root: run it as root (sudo tpuboot reset DBDF)"


def need_root(euid: int) -> None:
    """A reset by another user is refused before anything is read or written: sysfs's
    ``reset``, ``remove`` and ``rescan`` and the breaker's record are root's."""
    if euid != 0:
        raise ResetRefused(f"not root; {NEEDS_ROOT}")


@contextlib.contextmanager
def one_at_a_time(root: Root) -> Iterator[None]:
    """One ladder on the host at a time: the daemon's recovery.automatic and a `tpuboot reset`
    (or two of them) would otherwise reset one chip under each other, a rescan finds every
    function of the bus, and the breaker's record is read, changed and written. Never waits: a
    reset under way is a ResetRefused (the daemon looks again at its next tick)."""
    try:
        fd = open_lock(root, RESET_LOCK)
    except FileError as exc:  # refused, as a held lock is: the daemon says it once, not a bug
        raise ResetRefused(f"{exc}; {NEEDS_ROOT}" if os.geteuid() != 0 else str(exc)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResetRefused(
                "another reset is under way on this host (the daemon's recovery.automatic or another "
                "`tpuboot reset`); try again when it has ended"
            ) from None
        yield
    finally:
        os.close(fd)  # the lock goes with it


class Breaker:
    """At most ``limit`` resets of one chip in any hour, remembered under the Root."""

    def __init__(self, root: Root, limit: int, now: Callable[[], float] = time.time) -> None:
        self.root = root
        self.limit = limit
        self.now = now
        self._said: tuple[str, bytes | None] | None = None  # the damage last said, with the record

    def _load(self) -> dict[str, list[float]]:
        """The record: a damaged one (unreadable, not JSON, or not of the shape :meth:`record`
        writes) is forgotten whole, as if there were none, and said once (it does not block resets)."""
        try:
            raw = read_file(self.root, BREAKER_PATH)
        except FileReadError as exc:
            self._damaged(str(exc), None)
            return {}
        if raw is None:
            return {}
        try:
            record = _record(json.loads(raw))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            self._damaged(f"{BREAKER_PATH} is damaged ({_why(exc)})", raw)
            return {}
        self._said = None
        return record

    def _damaged(self, why: str, raw: bytes | None) -> None:
        """One journal line per damaged record (check and record read it in turn; the daemon, at
        each tick): the same damage is not said again until the record changes."""
        if self._said == (why, raw):
            return
        self._said = (why, raw)
        log.warning("reset breaker: %s; its resets are forgotten (the next reset writes it anew)", why)

    def chips(self) -> list[str]:
        """The chips in the record (reset in its last hour), whatever their times now."""
        return list(self._load())

    def recent(self, chip: str) -> list[float]:
        """This chip's resets in the last hour."""
        now = self.now()
        return [t for t in self._load().get(chip, []) if now - HOUR < t <= now]

    def check(self, chip: str) -> None:
        recent = self.recent(chip)
        if len(recent) >= self.limit:
            wait = int(min(recent) + HOUR - self.now()) + 1
            raise ResetRefused(
                f"chip {chip} was reset {len(recent)} times in the last hour (recovery.max_resets_per_hour "
                f"is {self.limit}); a chip that keeps wedging needs a new host: stop and start the VM, "
                f"or try again in {wait} s"
            )

    def record(self, chip: str) -> None:
        now = self.now()
        data = {k: [t for t in v if now - HOUR < t <= now] for k, v in self._load().items()}
        data = {k: v for k, v in data.items() if v}
        data.setdefault(chip, []).append(now)
        write_file(self.root, BREAKER_PATH, json.dumps(data, sort_keys=True).encode(), mode=0o600)


def _record(data: object) -> dict[str, list[float]]:
    """The breaker's record as :meth:`Breaker.record` writes it, {chip base address: [reset times
    as seconds since the epoch]}; ValueError for anything else."""
    if not isinstance(data, dict):
        raise ValueError(f"a {type(data).__name__}, not an object")
    record = {}
    for chip, times in data.items():
        if not is_chip_address(chip):
            raise ValueError(f"{shown(chip)} is not a chip's address")
        if not isinstance(times, list) or not all(_time(t) for t in times):
            raise ValueError(f"the resets of {chip} are not a list of times")
        record[chip] = [float(t) for t in times]
    return record


def _time(value: object) -> bool:
    """A time :meth:`Breaker.record` could have written: seconds since the epoch, before 2**33
    (the year 2242); not a bool, NaN, an infinity or a number too large for a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return 0 <= value < _LATEST  # NaN compares false; an int is compared before any float()


def _why(exc: Exception) -> str:
    return "nested too deep" if isinstance(exc, RecursionError) else str(exc)


class Ladder:
    """Climbs :data:`RUNGS` for one chip. ``write`` is how sysfs is written (the Binder's seam)."""

    def __init__(
        self,
        binder: Binder,
        breaker: Breaker,
        *,
        rescan_timeout: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.binder = binder
        self.root = binder.root
        self.breaker = breaker
        self.rescan_timeout = rescan_timeout
        self.sleep = sleep

    # --- what is possible -------------------------------------------------------------------

    def reset_methods(self, address: str) -> tuple[str, ...]:
        """The kernel's reset methods for one function; () when it offers none (no ``reset``)."""
        path = self.root.path(f"{PCI_DEVICES}/{address}")
        if not (path / "reset").exists():
            return ()
        try:
            methods = tuple((path / "reset_method").read_text(errors="replace").split())
        except OSError:  # before Linux 5.15 there is no reset_method, but ``reset`` works
            return ("default",)
        return methods

    def _removed(self, chip: Chip) -> bool:
        """The kernel has none of the chip's functions (a surprise link-down): only a rescan helps."""
        return not any(PciFunction(self.root, fn.address).exists() for fn in chip.functions)

    def plan(self, chip: Chip) -> list[str]:
        """What each rung would do to ``chip``, for --dry-run."""
        addresses = " ".join(fn.address for fn in chip.functions)
        if self._removed(chip):
            return [f"remove-rescan: {addresses} is gone from sysfs: rescan the PCI bus, bind it again"]
        methods = {fn.address: self.reset_methods(fn.address) for fn in chip.functions}
        if all(methods.values()):
            shown = ", ".join(f"{a}: {' '.join(m)}" for a, m in methods.items())
            first = f"function-reset: write 1 to reset of {addresses} ({shown})"
        else:
            first = f"function-reset: skipped, the kernel offers no reset method for {addresses}"
        return [
            first,
            f"rebind: unbind {addresses} from vfio-pci and bind again",
            f"remove-rescan: remove {addresses}, rescan the PCI bus, bind again",
        ]

    # --- climbing ---------------------------------------------------------------------------

    def climb(self, chip: Chip) -> list[Step]:
        """Every rung in turn until the chip is back; the steps taken, the last one back or not."""
        with one_at_a_time(self.root):
            self.breaker.check(chip.address)
            self.breaker.record(chip.address)
            return self._climb(chip)

    def _climb(self, chip: Chip) -> list[Step]:
        steps = []
        ladder = list(zip(RUNGS, (self._function_reset, self._rebind, self._remove_rescan), strict=True))
        if self._removed(chip):
            ladder = ladder[-1:]  # the kernel removed it already: only a rescan can find it again
        for rung, action in ladder:
            try:
                done = action(chip)
            except (TpubootError, OSError) as exc:
                steps.append(Step(rung, "failed", False, str(exc)))
                log.warning("%s: %s failed: %s", chip.address, rung, exc, extra={"DBDF": chip.address})
                continue
            if done is None:
                continue  # not possible on this chip; the next rung says more
            problem = self.problem(chip)
            steps.append(Step(rung, done, problem is None, problem))
            log.info(
                "%s: %s %s",
                chip.address,
                rung,
                "brought it back" if problem is None else f"did not help: {problem}",
                extra={"DBDF": chip.address, "TPU_RESET_RUNG": rung},
            )
            if problem is None:
                save_baseline(self.root, [read_health(self.root, fn.address) for fn in chip.functions])
                break
        return steps

    def problem(self, chip: Chip) -> str | None:
        """None when every function answers, is bound to vfio-pci and usable; else why not."""
        for fn in chip.functions:
            if not is_present(self.root, fn.address):
                return f"{fn.address} does not answer config reads"
            failure = self._bind(fn.address)
            if failure is not None:
                return failure
            status = describe(self.binder, PciFunction(self.root, fn.address))
            if status is None or status.driver != VFIO_PCI:
                return f"{fn.address} is not bound to vfio-pci"
            if status.problem:
                return status.problem
        return None

    def _bind(self, address: str) -> str | None:
        """Bind again after a rung; a transient failure is tried again (after a rescan the
        daemon binds the new function too, and the two may meet), a permanent one says why."""
        for attempt in range(BIND_TRIES):
            try:
                self.binder.bind(address)
                return None
            except DeviceError as exc:
                if not exc.transient or attempt == BIND_TRIES - 1:
                    return str(exc)
                self.sleep(0.5)
        return None  # not reached: the last try returned

    def _function_reset(self, chip: Chip) -> str | None:
        addresses = [fn.address for fn in chip.functions]
        if not all(self.reset_methods(a) for a in addresses):
            return None
        for address in addresses:
            self.binder.write(self.root.path(f"{PCI_DEVICES}/{address}/reset"), "1")
        return f"reset {' '.join(addresses)} ({' '.join(self.reset_methods(addresses[0]))})"

    def _rebind(self, chip: Chip) -> str:
        for fn in chip.functions:
            self.binder.unbind(fn.address)
        return "unbound and bound again"

    def _remove_rescan(self, chip: Chip) -> str:
        addresses = [fn.address for fn in chip.functions]
        for address in reversed(addresses):  # function 0 last: some devices drop the rest with it
            path = self.root.path(f"{PCI_DEVICES}/{address}/remove")
            if path.exists():
                self.binder.write(path, "1")
        self.binder.write(self.root.path(RESCAN), "1")
        missing = self._wait_present(addresses)
        if missing:
            raise DeviceError(f"{', '.join(missing)} did not come back after a rescan; stop and start the VM")
        return "removed and rescanned"

    def _wait_present(self, addresses: Sequence[str]) -> list[str]:
        deadline = time.monotonic() + self.rescan_timeout
        while True:
            missing = [a for a in addresses if not PciFunction(self.root, a).exists()]
            if not missing or time.monotonic() >= deadline:
                return missing
            self.sleep(0.05)
