"""`tpuboot who`: each chip (with its functions) and the processes holding it, the holders of
/dev/vfio/vfio, every libtpu lock file with its holder, and what the scan could not see.

Chips come from :func:`tpuboot.devices.chips.chips_present` (the one grouping, numbered as
tpu-info numbers them). A report is free only when every chip and lock is free *and* the scan saw
every process: a process holding a VFIO or accel device that cannot be tied to a chip, another
user's process whose fds could not be read, one whose reads blocked or one the scan had no time
for could each hold any chip, so each makes every chip "maybe held" (:meth:`Report.blockers`),
never free. `who` exits 0 only when free, and `wait-free`, `reset` and recovery wait or refuse on
the same answer. /dev/vfio/vfio is shown but decides nothing: any VFIO user opens it, TPU or not.

Text a user controls (command lines, unit, user and file names) is escaped where it is printed
(:func:`tpuboot.errors.printable`); ``as_dict`` keeps it exact for JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from tpuboot.config import Config
from tpuboot.devices.chips import VFIO_CONTAINER, Chip, chips_present
from tpuboot.devices.survey import survey
from tpuboot.devices.vfio import Binder
from tpuboot.errors import printable
from tpuboot.holders.locks import LockFile, locked
from tpuboot.holders.procfs import Process, ProcReader, iso
from tpuboot.holders.scan import Opened, Unseen, scan
from tpuboot.holders.targets import Targets, targets
from tpuboot.paths import Root

#: Which of tpuboot's agents a process is, if any (:class:`tpuboot.holders.supervised.Supervised`).
Agent = Callable[[Process], "str | None"]


def no_agent(p: Process) -> str | None:
    return None


@dataclass(frozen=True)
class Holder:
    """A process and the nodes of interest it has open."""

    process: Process
    nodes: tuple[str, ...]

    def as_dict(self, agent: Agent | None = None) -> dict[str, object]:
        """``agent``: tells tpuboot's agents (then ``tpuboot_agent`` says which, or null)."""
        named = {} if agent is None else {"tpuboot_agent": agent(self.process)}
        return {**self.process.as_dict(), "nodes": list(self.nodes), **named}


@dataclass(frozen=True)
class ChipHolders:
    chip: Chip
    holders: tuple[Holder, ...]

    def as_dict(self, agent: Agent | None = None) -> dict[str, object]:
        c = self.chip
        return {
            "index": c.index,
            "address": c.address,
            "kind": c.kind,
            "functions": [fn.address for fn in c.functions],
            "nodes": list(c.nodes),
            "holders": [h.as_dict(agent) for h in self.holders],
        }


@dataclass(frozen=True)
class Report:
    chips: list[ChipHolders]
    vfio_container: tuple[Holder, ...]
    locks: list[LockFile]
    unknown: tuple[Holder, ...] = ()  # holders of a VFIO or accel device tied to no chip: any chip's
    unseen: Unseen = field(default_factory=Unseen)

    @property
    def held_locks(self) -> list[LockFile]:
        return [lock for lock in self.locks if lock.held]

    @property
    def free(self) -> bool:
        """No chip has a holder, no lock file is held, and nothing unseen could hold one."""
        return not any(c.holders for c in self.chips) and not self.held_locks and not self.maybe_held

    @property
    def maybe_held(self) -> bool:
        """Something may hold any chip: a holder of an unknown chip, or processes not seen."""
        return bool(self.unknown) or bool(self.unseen)

    def holder_counts(self) -> dict[tuple[str, str], int]:
        """(chip's base address, process state): holders; every chip has its ("running") series."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.chips:
            counts.setdefault((c.chip.address, "running"), 0)
            for h in c.holders:
                key = (c.chip.address, h.process.state)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def lock_states(self) -> dict[str, bool]:
        """Each libtpu lock file and whether a process holds it."""
        return {lock.path: lock.held for lock in self.locks}

    def blockers(self, chip: Chip) -> list[str]:
        """Why ``chip`` may not be free, one line each: its holders, holders of a chip unknown,
        and what the scan could not see; [] only when it is certainly free."""
        held = next((c for c in self.chips if c.chip.address == chip.address), None)
        lines = [describe(h.process) for h in held.holders] if held else []
        lines += [
            f"{describe(h.process)}, chip unknown: {printable(', '.join(h.nodes))}" for h in self.unknown
        ]
        return lines + self.unseen.phrases()

    def processes(self) -> list[Process]:
        """Every holder of a chip (known or not), of /dev/vfio/vfio or of a lock, once each, by PID."""
        seen: dict[int, Process] = {}
        for c in self.chips:
            seen.update((h.process.pid, h.process) for h in c.holders)
        seen.update((h.process.pid, h.process) for h in (*self.unknown, *self.vfio_container))
        seen.update((lock.holder.pid, lock.holder) for lock in self.locks if lock.holder)
        return [seen[pid] for pid in sorted(seen)]

    def chip_pids(self) -> set[int]:
        """Holders of a chip, known or not."""
        return {h.process.pid for c in self.chips for h in c.holders} | {h.process.pid for h in self.unknown}

    def as_dict(self, agent: Agent | None = None) -> dict[str, object]:
        """``agent``: which processes are tpuboot's agents (:mod:`tpuboot.holders.supervised`)."""
        return {
            "free": self.free,
            "chips": [c.as_dict(agent) for c in self.chips],
            "unknown_chip_holders": [h.as_dict(agent) for h in self.unknown],
            "vfio_container": [h.as_dict(agent) for h in self.vfio_container],
            "locks": [lock.as_dict() for lock in self.locks],
            **self.unseen.as_dict(),
        }


def _holders(opened: Opened, processes: dict[int, Process], keys: Iterable[str]) -> tuple[Holder, ...]:
    wanted = set(keys)
    found = []
    for pid in sorted(opened.nodes):
        held = opened.nodes[pid] & wanted
        if held and pid in processes:  # not there: it exited since the scan, and holds nothing now
            found.append(Holder(processes[pid], tuple(sorted(held))))
    return tuple(found)


def chips_of(root: Root, config: Config) -> list[Chip]:
    binder = Binder.of(root, config)
    return chips_present(root, binder.table, survey(binder))


def blockers_of(root: Root) -> Callable[[Chip], list[str]]:
    """Who may hold one chip, by the /proc scan of `tpuboot who` (automatic recovery asks it)."""
    return lambda chip: gather(root, [chip]).blockers(chip)


def gather(root: Root, chips: Sequence[Chip]) -> Report:
    """Who holds ``chips`` and the libtpu lock files now: one /proc scan."""
    wanted: Targets = targets(root, chips)
    opened = scan(root, wanted)
    reader = ProcReader(root)
    lock_files = locked(root)
    processes = reader.processes([*opened.nodes, *opened.unknown, *lock_files.holder_pids()])
    locks = lock_files.described(reader, processes)
    held = [ChipHolders(chip, _holders(opened, processes, wanted.keys_of(chip))) for chip in chips]
    container = _holders(opened, processes, [VFIO_CONTAINER])
    unknown = tuple(
        Holder(processes[pid], tuple(sorted(what)))
        for pid, what in sorted(opened.unknown.items())
        if pid in processes
    )
    return Report(held, container, locks, unknown, opened.unseen())


# --- text --------------------------------------------------------------------------------------


def describe(p: Process) -> str:
    """One process in one line: PID, user, state, start, where it runs, its command (the text
    its user controls escaped)."""
    ns = (
        f", PID {p.namespace_pid} in {printable(p.pid_namespace or '')}"
        if p.namespace_pid is not None
        else ""
    )
    started = f", started {iso(p.started)}" if p.started is not None else ""
    who = f"{printable(p.user)}, {p.state}{started}, {printable(p.where)}{ns}"
    return f"PID {p.pid} ({who}): {printable(p.command)}"


def summary(c: ChipHolders, report: Report | None = None) -> str:
    """A chip's holders for `tpuboot status`: "free", "maybe held" (``report`` saw a holder of a
    chip unknown, or not every process) or the PIDs with their commands."""
    if not c.holders:
        if report is not None and report.maybe_held:
            return "maybe held: " + "; ".join(report.blockers(c.chip))
        return "free"
    return "held by " + "; ".join(
        f"PID {h.process.pid} ({h.process.state}) {printable(h.process.command)}" for h in c.holders
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
    return f"lock {printable(lock.path)}  owner {printable(lock.owner)} mode {lock.mode}  {by}"


def render(report: Report, agent: Agent = no_agent) -> list[str]:
    """`tpuboot who`; ``agent`` names tpuboot's agents among the holders."""

    def holder(p: Process) -> str:
        why = agent(p)
        return describe(p) + (f"  [{why}: release --kill spares it]" if why else "")

    lines = []
    if not report.chips:
        lines.append("no TPU chips found")
    for c in report.chips:
        chip = c.chip
        functions = ", ".join(fn.address for fn in chip.functions)
        nodes = " ".join(chip.nodes) or "no node (not bound)"
        lines.append(f"chip {chip.index}  {chip.kind}  {nodes}  (functions {functions})")
        lines += [f"    {holder(h.process)}" for h in c.holders] or ["    free"]
    if report.unknown:
        lines.append("holding a VFIO or accel device of a chip unknown (it may be any chip's):")
        lines += [f"    {holder(h.process)}: {printable(', '.join(h.nodes))}" for h in report.unknown]
    if report.vfio_container:
        lines.append(f"{VFIO_CONTAINER}:")
        lines += [f"    {holder(h.process)}" for h in report.vfio_container]
    lines += [lock_line(lock) for lock in report.locks] or ["no libtpu lock file"]
    lines += [f"not seen: {phrase}; a chip shown free may be held" for phrase in report.unseen.phrases()]
    return lines
