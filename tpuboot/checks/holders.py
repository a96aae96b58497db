"""Doctor's checks on who holds the TPU, and on memlock where it matters.

- ``chip-holders``: a chip held by a stopped, zombie or uninterruptible process is a FAIL (it will
  not let go by itself); a chip in use by a live process is a PASS that names it.
- ``libtpu-locks``: a lock file nobody holds that another user owns is a FAIL (libtpu's 0600 file
  keeps every other user out); a lock held by a process with no chip open is a WARN (a leftover
  worker, or a parent that loaded libtpu and handed the chips to children).
- ``memlock``: vfio_iommu_type1 charges the DMA memory a process pins to ITS RLIMIT_MEMLOCK unless
  it has CAP_IPC_LOCK, so the limit that matters is that of the process opening the chip: every
  current holder, the units named in ``doctor.job_units``, and dockerd and containerd, whose
  containers inherit their limit (not their capabilities: an engine's own CAP_IPC_LOCK excuses
  nothing). limits.conf reaches PAM logins only, so /proc/PID/limits is read, not the files.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

from tpuboot.checks.limits import ENGINES
from tpuboot.checks.parsers.systemd import Systemd
from tpuboot.config import UNIT_SUFFIXES, Config
from tpuboot.devices.chips import Chip
from tpuboot.errors import printable
from tpuboot.holders.locks import LockFile
from tpuboot.holders.procfs import STUCK, Process, memlock
from tpuboot.holders.report import Report, describe, gather, lock_holder
from tpuboot.kernelfiles import read_text
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, failed, passed, skipped, warned

CGROUP_ROOT = "/sys/fs/cgroup"
SLICE = "system.slice"
CHIP_HOLDERS = Criterion("chip-holders", "no chip held by a stopped, zombie or uninterruptible process")
LIBTPU_LOCKS = Criterion("libtpu-locks", "no libtpu lock file of another user's that nobody holds")
MEMLOCK = Criterion(
    "memlock",
    "memlock enough for a chip's DMA in whatever opens one: its holders, doctor.job_units, the engines",
)


def stuck_fix(p: Process) -> str:
    if p.state == "zombie":
        return f"end or restart its parent, PID {p.ppid} (only the parent can reap a zombie)"
    if p.state == "stopped":
        return f"kill -CONT {p.pid} to let it go on, or tpuboot release --kill to end it"
    return f"PID {p.pid} waits in the kernel (I/O or a device); if it stays so, reboot the VM"


def main_pid(root: Root, unit: str, systemd: Systemd) -> int | None:
    """The main PID of ``unit``: systemd's MainPID on the host, else the first PID in its cgroup."""
    if systemd.live(root):
        shown = systemd.show(unit, ["MainPID"]) or {}
        pid = ascii_int(shown.get("MainPID", "0"))
        return pid if pid else None
    text = read_text(root, f"{CGROUP_ROOT}/{SLICE}/{unit}/cgroup.procs") or ""
    pids = [pid for word in text.split() if (pid := ascii_int(word))]
    return pids[0] if pids else None


class HolderChecks:
    """The three checks, sharing one scan of /proc (made on first use)."""

    def __init__(
        self, root: Root, config: Config, chips: Callable[[], Sequence[Chip]], systemd: Systemd | None = None
    ) -> None:
        self.root = root
        self.config = config
        self.chips = chips
        self.systemd = systemd or Systemd()

    def named(self) -> list[tuple[Criterion, Callable[[], CheckResult]]]:
        """The checks, in run order, for the doctor's table."""
        return [
            (CHIP_HOLDERS, self.check_chip_holders),
            (LIBTPU_LOCKS, self.check_locks),
            (MEMLOCK, self.check_memlock),
        ]

    @functools.cached_property
    def report(self) -> Report:
        return gather(self.root, self.chips())

    def check_chip_holders(self) -> CheckResult:
        report = self.report
        if not report.chips:
            return skipped("no TPU chip on this machine")
        stuck = [(c.chip, h.process) for c in report.chips for h in c.holders if h.process.state in STUCK]
        if stuck:
            what = "; ".join(f"chip {chip.index} held by {describe(p)}" for chip, p in stuck)
            return failed(what, stuck_fix(stuck[0][1]))
        used = [
            f"chip {c.chip.index}: PID {', '.join(str(h.process.pid) for h in c.holders)}"
            for c in report.chips
            if c.holders
        ]
        if report.unknown:
            what = "; ".join(
                f"{describe(h.process)} holds {printable(', '.join(h.nodes))}" for h in report.unknown
            )
            return warned(
                f"{what}: a VFIO or accel device tied to no chip, so any chip may be held",
                "tpuboot who; if it is a TPU job, let it end or end it (tpuboot release --kill does not)",
            )
        unseen = "".join(f"; not seen: {phrase}" for phrase in report.unseen.phrases())
        if used:
            return passed(f"in use by live processes ({'; '.join(used)}){unseen}")
        return passed(f"{len(report.chips)} chips free{unseen}" if not unseen else f"no holder seen{unseen}")

    def check_locks(self) -> CheckResult:
        report = self.report
        if not report.locks:
            return passed("no libtpu lock file")
        me = os.geteuid()
        blocking = [lock for lock in report.locks if not lock.held and lock.uid != me]
        if blocking:
            return failed(
                "; ".join(
                    f"{lock.path} (owner {lock.owner}, mode {lock.mode}) is held by nobody"
                    for lock in blocking
                )
                + ": libtpu of any other user cannot open it",
                "tpuboot release (it removes lock files nobody holds)",
            )
        chip_pids = report.chip_pids()
        # An open file description lock names no PID: whether its holder has a chip open is unknown.
        stray = [lock for lock in report.held_locks if lock.holder_pid not in (None, *chip_pids)]
        if stray:
            return warned(
                "; ".join(
                    f"{lock.path} held by {lock_holder(lock)}, which has no chip open" for lock in stray
                ),
                "tpuboot who; if it is a leftover worker, tpuboot release --kill",
            )
        return passed("; ".join(_lock_state(lock) for lock in report.locks))

    def memlock_targets(self) -> list[tuple[str, int, bool]]:
        """(what, PID, whether CAP_IPC_LOCK excuses it) of each process whose limit matters."""
        targets = []
        for name, unit in ENGINES:
            pid = main_pid(self.root, unit, self.systemd)
            if pid is not None:
                targets.append((f"{name} (PID {pid}; its containers inherit the limit)", pid, False))
        for unit in self.config.doctor.job_units:
            pid = main_pid(self.root, unit, self.systemd)
            if pid is not None:
                targets.append((f"{unit} (PID {pid})", pid, True))
        for p in self.report.processes():
            if p.state != "zombie":
                targets.append((f"holder PID {p.pid} ({p.command[:60]})", p.pid, True))
        return targets

    def check_memlock(self) -> CheckResult:
        limited, fixes, fine = [], [], []
        for what, pid, cap_counts in self.memlock_targets():
            found = memlock(self.root, pid)
            if found is None:
                continue  # exited meanwhile
            if found.unlimited or (cap_counts and found.cap_ipc_lock):
                fine.append(what.split(" (", 1)[0])
                continue
            limited.append(f"{what}: max locked memory {found.soft} bytes, no CAP_IPC_LOCK")
            fixes.append(_memlock_fix(what))
        if limited:
            return failed("; ".join(limited), "; ".join(dict.fromkeys(fixes)))
        if not fine:
            return skipped("no dockerd, containerd, job unit (doctor.job_units) or chip holder running")
        return passed(f"memlock unlimited or CAP_IPC_LOCK: {', '.join(fine)}")


def _memlock_fix(what: str) -> str:
    name = what.split(" ", 1)[0]
    unit = dict(ENGINES).get(name)
    if unit is not None:
        return (
            f"systemctl edit {unit}: [Service] LimitMEMLOCK=infinity, then systemctl restart {unit} "
            "(or run TPU containers with --ulimit memlock=-1:-1)"
        )
    if name.endswith(UNIT_SUFFIXES):
        return f"systemctl edit {name}: [Service] LimitMEMLOCK=infinity, then systemctl restart {name}"
    return (
        "start the job with memlock unlimited: LimitMEMLOCK=infinity in its unit, "
        "docker run --ulimit memlock=-1:-1, or ulimit -l unlimited in its shell"
    )


def _lock_state(lock: LockFile) -> str:
    if not lock.held:
        return f"{lock.path} not held (owner {lock.owner})"
    by = f"PID {lock.holder_pid}" if lock.holder_pid is not None else lock_holder(lock)
    return f"{lock.path} held by {by}"
