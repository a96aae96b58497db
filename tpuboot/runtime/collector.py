"""The daemon's part: poll libtpu's metric service while a process holds a chip, and only then.

The daemon's tick (tpuboot/daemon.py) hands :meth:`RuntimeCollector.tick` to its pool: one look at
who holds the chips of the tick's device snapshot (the /proc scan of `tpuboot who`; none at all on
a host with no chip). While one is held, a thread of the collector's own polls every ``interval``
(GKE's pace, 10 s): each port of tpu-env's ``TPU_RUNTIME_METRICS_PORTS`` that a chip's holder
listens on, each call with its deadline. When no chip is held any more the thread ends and the
series go: an idle host has no thread and makes no call. Nothing here runs on the daemon's loop, so
a libtpu that hangs delays neither the loop nor the watchdog.

Each port's trouble (no answer, a reset, a message too large or malformed, samples of the wrong
type) is one journal line when it begins and one when it ends, never one per poll; the other
ports' readings stand. A hang or slice error turning on is an error line with structured fields.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tpuboot.atomicfile import FileError, read_file
from tpuboot.component import Part, Report, Status
from tpuboot.config import Config
from tpuboot.env.tpuenv import env_value, parse_env_file
from tpuboot.errors import printable
from tpuboot.holders.procfs import Process
from tpuboot.holders.sockets import port_inodes, socket_owners
from tpuboot.paths import Root
from tpuboot.runtime import statefile
from tpuboot.runtime.client import CallError, connect, grpc_missing
from tpuboot.runtime.ports import runtime_ports
from tpuboot.runtime.reading import PortReading, read_port

if TYPE_CHECKING:
    from tpuboot.devices.chips import Chip
    from tpuboot.devices.snapshot import DeviceSnapshot

log = logging.getLogger("tpuboot.runtime")

RuntimeState = Literal["off", "idle", "polling", "fault"]
MAX_TPU_ENV = 64 << 10


@dataclass(frozen=True)
class Holders:
    """The chips present and the processes holding one (by PID), from one scan."""

    chips: int
    processes: Mapping[int, Process]


@dataclass(frozen=True)
class Polled:
    """One port in one poll: its holder, and its reading or why there is none."""

    port: int
    holder: Process
    reading: PortReading | None
    error: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """The last poll of every port a holder listens on; empty while no chip is held."""

    ports: tuple[Polled, ...] = ()
    model: str = ""
    topology: str = ""
    host: str = ""

    @property
    def hang(self) -> bool:
        return any(p.reading is not None and p.reading.hang for p in self.ports)

    @property
    def slice_errors(self) -> list[str]:
        return [p.reading.slice_error for p in self.ports if p.reading and p.reading.slice_error is not None]


def scan_holders(root: Root, config: Config, chips: Sequence[Chip] | None = None) -> Holders:
    """Who holds the chips now (``chips``, else those present), as `tpuboot who` sees it; no
    scan when there is no chip."""
    from tpuboot.holders.report import chips_of, gather

    chips = chips_of(root, config) if chips is None else chips
    if not chips:
        return Holders(0, {})
    report = gather(root, chips)
    found = {h.process.pid: h.process for c in report.chips for h in c.holders}
    found.update((h.process.pid, h.process) for h in report.unknown)
    return Holders(len(chips), found)


@dataclass(frozen=True)
class Targets:
    """What to poll, from tpu-env: the ports, the labels GKE puts on each device's series, and
    why the port list was not used (one line) when it was garbage."""

    ports: tuple[int, ...]
    model: str = ""
    topology: str = ""
    problem: str | None = None


def targets(root: Root, config: Config, held: Holders) -> Targets:
    """The ports and labels for ``held``'s chips, from the tpu-env file as the jobs read it."""
    env = _tpu_env(root, config)
    ports, problem = runtime_ports(env, held.chips)
    if env is None:
        return Targets(ports, problem=problem)
    model = printable(env_value(env, "ACCELERATOR_TYPE") or "")
    return Targets(ports, model, printable(env_value(env, "TOPOLOGY") or ""), problem)


def _tpu_env(root: Root, config: Config) -> dict[str, str] | None:
    if not config.env.enabled:
        return None
    try:
        data = read_file(root, config.env.tpu_env_path, limit=MAX_TPU_ENV)
    except FileError:
        return None
    return None if data is None else parse_env_file(data.decode("utf-8", "replace"))


@dataclass
class _Said:
    """What trouble was last said of each port, so a trouble is one line, not one per poll:
    ``which`` names the trouble (the same trouble may read differently from poll to poll)."""

    troubles: dict[tuple[int, str], str] = field(default_factory=dict)

    def say(self, port: int, what: str, which: str | None, line: str, fields: dict[str, Any]) -> None:
        key = (port, what)
        if which == self.troubles.get(key):
            return
        if which is None:
            self.troubles.pop(key, None)
            log.info("runtime metrics: port %d: %s answers again", port, what, extra=fields)
        else:
            self.troubles[key] = which
            log.warning("runtime metrics: %s", line, extra=fields)


class RuntimeCollector(Part):
    """libtpu's runtime metrics of the jobs on this host (a part of `tpuboot run`): its tick looks
    for a chip's holders, a poller thread of its own asks them while one is held."""

    name = "runtime metrics"

    def __init__(
        self,
        root: Root,
        config: Config,
        *,
        holders: Callable[[], Holders] | None = None,
        host: str | None = None,
        proc: Root | None = None,
    ) -> None:
        """Seams (tests): ``holders`` (the scan), ``host`` (the accelerator ids' prefix), ``proc``
        (the root whose /proc/net/tcp and fds name the ports' listeners; ``root`` by default)."""
        self.root = root
        self.proc = proc or root
        self.config = config
        self.interval = config.runtime_metrics.interval
        self.timeout = config.runtime_metrics.timeout
        self._holders = holders  # None: the /proc scan of the chips present
        self.host = host if host is not None else socket.gethostname()
        self.missing = grpc_missing()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: Mapping[int, Process] = {}
        self._ports: tuple[int, ...] = ()
        self._model = self._topology = ""
        self._stopping = False
        self._snapshot = Snapshot()
        self._status = Status("off", "") if self.missing else Status("idle", "")
        self._report: Report = lambda: None
        self._said = _Said()
        self._owners: tuple[frozenset[int], dict[int, set[int]]] = (frozenset(), {})
        self._env_said: str | None = None
        self._scan_said: str | None = None
        self.polls = 0  # polls made (bench/ and the tests count them)

    # --- the part -------------------------------------------------------------------------

    def start(self, report: Report) -> None:
        self._report = report
        if self.missing:
            log.warning("runtime metrics: %s", self.missing)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None:  # a poll in flight ends at its deadline; the stop waits a second at most
            thread.join(min(self.timeout, 1.0))

    def status(self) -> Status:
        return self._status

    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def polling(self) -> bool:
        """A poller thread runs (a chip is held)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    # --- the tick's look (in the daemon's pool) ----------------------------------------------

    @property
    def periodic(self) -> bool:
        return self.missing is None  # without grpcio, nothing to look for

    def tick(self, devices: DeviceSnapshot) -> None:
        self.check(devices)

    def check(self, devices: DeviceSnapshot | None = None) -> None:
        """Is a chip held? Start polling if so, end it if not (from the daemon's pool). ``devices``:
        the tick's snapshot, whose chips are scanned for (default: read now)."""
        if self.missing or self._stopping:
            return
        try:
            if self._holders is not None:
                held = self._holders()
            else:
                held = scan_holders(self.root, self.config, None if devices is None else devices.chips)
            said = None
        except Exception as exc:  # a scan that fails is said once, and nothing is polled
            held, said = Holders(0, {}), f"runtime metrics: the holders were not scanned: {exc}"
        if said != self._scan_said:
            self._scan_said = said
            if said:
                log.warning("%s", said)
        target = targets(self.root, self.config, held) if held.processes else Targets(())
        if held.processes and target.problem != self._env_said:
            self._env_said = target.problem
            if target.problem:
                log.warning("runtime metrics: %s", target.problem)
        with self._lock:
            if self._stopping:
                return
            self._held = held.processes
            self._ports, self._model, self._topology = target.ports, target.model, target.topology
            if held.processes and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tpuboot-runtime", daemon=True)
                self._thread.start()
            elif not held.processes:
                self._publish(Snapshot())  # the series go now, whatever the poller is doing
                self._wake.set()  # the poller sees no holder and ends

    # --- the poller thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._held or self._stopping:
                    self._thread = None
                    self._publish(Snapshot())
                    return
                held, ports = self._held, self._ports
                model, topology = self._model, self._topology
            try:
                self.poll_once(held, ports, model, topology)
            except Exception:  # a bug: said, and the poller goes on
                log.exception("runtime metrics: the poll failed; please report it")
            self._wake.wait(self.interval)
            self._wake.clear()

    def _listeners(self, ports: tuple[int, ...]) -> dict[int, set[int]]:
        """Each port listened on, with its listeners' PIDs; the /proc walk that names them is made
        again only when the listening sockets change."""
        inodes = port_inodes(self.proc, ports)
        every = frozenset().union(*inodes.values()) if inodes else frozenset()
        known, owners = self._owners
        if every != known:
            owners = socket_owners(self.proc, set(every))
            self._owners = (every, owners)
        return {port: {pid for i in held for pid in owners.get(i, ())} for port, held in inodes.items()}

    def poll_once(
        self, held: Mapping[int, Process], ports: tuple[int, ...], model: str = "", topology: str = ""
    ) -> Snapshot:
        """Every port a holder listens on, polled once; the snapshot published and returned."""
        self.polls += 1
        polled = []
        for port, pids in sorted(self._listeners(ports).items()):
            holder = next((held[pid] for pid in sorted(pids) if pid in held), None)
            if holder is None:
                continue  # not a chip holder's: not libtpu's service to ask
            fields = {"PORT": str(port), "HOLDER_PID": str(holder.pid)}
            try:
                with connect(port, self.timeout) as client:
                    reading = read_port(client)
                error, which = None, None
            except CallError as exc:
                reading, error, which = None, str(exc), exc.kind
            self._said.say(port, "the service", which, error or "", fields)
            problems = "; ".join(reading.problems) if reading else ""
            if reading is not None:
                self._said.say(port, "its samples", problems or None, f"port {port}: {problems}", fields)
            polled.append(Polled(port, holder, reading, error))
        snapshot = Snapshot(tuple(polled), model, topology, self.host)
        with self._lock:
            if not self._stopping:
                self._publish(snapshot)
        return snapshot

    # --- what is shown --------------------------------------------------------------------

    def _publish(self, snapshot: Snapshot) -> None:
        """The new snapshot, its faults to the journal and the state file when they changed, and
        the daemon told when STATUS changes."""
        before = self._snapshot
        self._snapshot = snapshot
        self._faults_said(before, snapshot)
        state = _state_of(snapshot)
        if state != _state_of(before):
            try:
                if snapshot.ports:
                    statefile.save(self.root, state)
                else:
                    statefile.clear(self.root)
            except FileError as exc:
                log.warning("runtime metrics: %s", exc)
        status = _status_of(snapshot)
        if status != self._status:
            self._status = status
            self._report()

    def _faults_said(self, before: Snapshot, now: Snapshot) -> None:
        was = {p.port: p.reading for p in before.ports}
        for p in now.ports:
            old, new = was.get(p.port), p.reading
            if new is None:
                continue
            fields = {"PORT": str(p.port), "HOLDER_PID": str(p.holder.pid), "HOLDER": p.holder.where}
            if new.hang and not (old and old.hang):
                log.error(
                    "runtime metrics: libtpu reports a megascale hang (HANG_DETECTED) on port %d, PID %d "
                    "(%s): the job is stuck; its logs say where",
                    p.port, p.holder.pid, printable(p.holder.where),
                    extra={**fields, "FAULT": "hang"},
                )  # fmt: skip
            elif old and old.hang and not new.hang:
                log.info(
                    "runtime metrics: the hang on port %d ended", p.port, extra={**fields, "FAULT": "hang"}
                )
            if new.slice_error is not None and (old is None or old.slice_error is None):
                log.error(
                    "runtime metrics: libtpu reports a slice error on port %d, PID %d: %s",
                    p.port, p.holder.pid, printable(new.slice_error) or "no message",
                    extra={**fields, "FAULT": "slice-error"},
                )  # fmt: skip
            elif old and old.slice_error is not None and new.slice_error is None:
                log.info(
                    "runtime metrics: the slice error on port %d ended",
                    p.port, extra={**fields, "FAULT": "slice-error"},
                )  # fmt: skip


def _state_of(snapshot: Snapshot) -> list[dict[str, Any]]:
    """The state file's ports: faults and holders, not values (so a poll changes it rarely)."""
    return [
        {
            "port": p.port,
            "pid": p.holder.pid,
            "holder": p.holder.where,
            "hang": bool(p.reading and p.reading.hang),
            "slice_error": p.reading.slice_error if p.reading else None,
            "error": p.error,
        }
        for p in snapshot.ports
    ]


def _status_of(snapshot: Snapshot) -> Status:
    """STATUS's words: quiet while nothing is polled, the fault when there is one."""
    if not snapshot.ports:
        return Status("idle", "")
    pids = ", ".join(sorted({str(p.holder.pid) for p in snapshot.ports}))
    if snapshot.hang:
        return Status("fault", f"libtpu: HANG detected (PID {pids})")
    if snapshot.slice_errors:
        return Status("fault", f"libtpu: slice error (PID {pids})")
    devices = sum(len(p.reading.devices) for p in snapshot.ports if p.reading)
    failing = sum(1 for p in snapshot.ports if p.reading is None)
    trouble = f", {failing} port{'s' if failing > 1 else ''} not answering" if failing else ""
    return Status("polling", f"libtpu: {devices} devices read (PID {pids}){trouble}")
