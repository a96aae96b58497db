"""`tpuboot who`: each chip (with its functions) and the processes holding its nodes, the holders
of /dev/vfio/vfio, and every libtpu lock file with its holder.

Chips come from :func:`tpuboot.devices.chips.chips_present` (the one grouping, numbered as
tpu-info numbers them). Every chip and lock is free, or something is held: `who` exits 0 or 1 on
that, and `wait-free` waits for it. /dev/vfio/vfio is shown but decides nothing: any VFIO user
opens it, TPU or not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tpuboot.config import Config
from tpuboot.devices.chips import VFIO_CONTAINER, Chip, chips_present
from tpuboot.devices.survey import survey
from tpuboot.devices.table import DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.holders.locks import LockFile, find_locks
from tpuboot.holders.procfs import Process, ProcReader, iso
from tpuboot.holders.scan import Opened, scan
from tpuboot.paths import Root


@dataclass(frozen=True)
class Holder:
    """A process and the nodes of interest it has open."""

    process: Process
    nodes: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {**self.process.as_dict(), "nodes": list(self.nodes)}


@dataclass(frozen=True)
class ChipHolders:
    chip: Chip
    holders: tuple[Holder, ...]

    def as_dict(self) -> dict[str, object]:
        c = self.chip
        return {
            "index": c.index,
            "address": c.address,
            "kind": c.kind,
            "functions": [fn.address for fn in c.functions],
            "nodes": list(c.nodes),
            "holders": [h.as_dict() for h in self.holders],
        }


@dataclass(frozen=True)
class Report:
    chips: list[ChipHolders]
    vfio_container: tuple[Holder, ...]
    locks: list[LockFile]
    unreadable: list[int] = field(default_factory=list)  # PIDs whose fds could not be read

    @property
    def held_locks(self) -> list[LockFile]:
        return [lock for lock in self.locks if lock.held]

    @property
    def free(self) -> bool:
        """No chip has a holder and no lock file is held."""
        return not any(c.holders for c in self.chips) and not self.held_locks

    def processes(self) -> list[Process]:
        """Every holder of a chip, of /dev/vfio/vfio or of a lock, once each, by PID."""
        seen: dict[int, Process] = {}
        for c in self.chips:
            seen.update((h.process.pid, h.process) for h in c.holders)
        seen.update((h.process.pid, h.process) for h in self.vfio_container)
        seen.update((lock.holder.pid, lock.holder) for lock in self.locks if lock.holder)
        return [seen[pid] for pid in sorted(seen)]

    def chip_pids(self) -> set[int]:
        return {h.process.pid for c in self.chips for h in c.holders}

    def as_dict(self) -> dict[str, object]:
        return {
            "free": self.free,
            "chips": [c.as_dict() for c in self.chips],
            "vfio_container": [h.as_dict() for h in self.vfio_container],
            "locks": [lock.as_dict() for lock in self.locks],
            "unreadable_pids": self.unreadable,
        }


def _holders(opened: Opened, reader: ProcReader, nodes: Iterable[str]) -> tuple[Holder, ...]:
    wanted = set(nodes)
    found = []
    for pid in sorted(opened.nodes):
        held = opened.nodes[pid] & wanted
        if not held:
            continue
        process = reader.process(pid)
        if process is not None:  # exited since the scan: it holds nothing now
            found.append(Holder(process, tuple(sorted(held))))
    return tuple(found)


def chips_of(root: Root, config: Config) -> list[Chip]:
    binder = Binder(root, DeviceTable(config.devices), config.vfio)
    return chips_present(root, binder.table, survey(binder))


def gather(root: Root, chips: Sequence[Chip]) -> Report:
    """Who holds ``chips`` and the libtpu lock files now: one /proc scan."""
    nodes = [node for chip in chips for node in chip.nodes]
    opened = scan(root, [*nodes, VFIO_CONTAINER])
    reader = ProcReader(root)
    held = [ChipHolders(chip, _holders(opened, reader, chip.nodes)) for chip in chips]
    container = _holders(opened, reader, [VFIO_CONTAINER])
    return Report(held, container, find_locks(root, reader), sorted(opened.unreadable))


# --- text --------------------------------------------------------------------------------------


def describe(p: Process) -> str:
    """One process in one line: PID, user, state, start, where it runs, its command."""
    ns = f", PID {p.namespace_pid} in {p.pid_namespace}" if p.namespace_pid is not None else ""
    started = f", started {iso(p.started)}" if p.started is not None else ""
    return f"PID {p.pid} ({p.user}, {p.state}{started}, {p.where}{ns}): {p.command}"


def summary(c: ChipHolders) -> str:
    """A chip's holders for `tpuboot status`: "free" or the PIDs with their commands."""
    if not c.holders:
        return "free"
    return "held by " + "; ".join(
        f"PID {h.process.pid} ({h.process.state}) {h.process.command}" for h in c.holders
    )


def lock_holder(lock: LockFile) -> str:
    """Who holds ``lock``: the process, else its PID; an open file description lock has none."""
    if lock.holder is not None:
        return describe(lock.holder)
    if lock.holder_pid is not None:
        return f"PID {lock.holder_pid}"
    return "a process /proc/locks cannot name (an open file description lock)"


def lock_line(lock: LockFile) -> str:
    by = f"held by {lock_holder(lock)}" if lock.held else "not held"
    return f"lock {lock.path}  owner {lock.owner} mode {lock.mode}  {by}"


def render(report: Report) -> list[str]:
    lines = []
    if not report.chips:
        lines.append("no TPU chips found")
    for c in report.chips:
        chip = c.chip
        functions = ", ".join(fn.address for fn in chip.functions)
        nodes = " ".join(chip.nodes) or "no node (not bound)"
        lines.append(f"chip {chip.index}  {chip.kind}  {nodes}  (functions {functions})")
        lines += [f"    {describe(h.process)}" for h in c.holders] or ["    free"]
    if report.vfio_container:
        lines.append(f"{VFIO_CONTAINER}:")
        lines += [f"    {describe(h.process)}" for h in report.vfio_container]
    lines += [lock_line(lock) for lock in report.locks] or ["no libtpu lock file"]
    if report.unreadable:
        lines.append(
            f"{len(report.unreadable)} processes' open files could not be read (run as root to see all)"
        )
    return lines
