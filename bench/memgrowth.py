"""``python -m bench.memgrowth --minutes N``: what grows in tpuboot's daemon under the soak's faults.

The soak (``bench/soak.py``) measures RSS from outside a guest at the pace of a real host; this
runs the daemon in-process, as ``tpuboot run`` builds it (:func:`tpuboot.wiring.build`), over the
unit tests' fakes (a fake kernel's sysfs tree, a fake dockerd on a unix socket, the metadata
emulator) and drives the soak's moves at many times its pace: hotplug add and remove, the
soak's metadata faults (``bench.soak.FAULTS``) and tpu-env documents (``bench.soak.CATALOG``),
vBar kills and dockerd restarts, with a watchdog tick every 0.2 s. After ``--warmup`` seconds it
takes a tracemalloc snapshot, again half-way to the end and at the end, and prints the
allocation sites whose live size grew most (over each half and over both: a leak grows in
each; only allocations with a tpuboot frame in their stack, the fakes' own left out), the
object counts by type that grew, the sites of pymalloc's blocks (512 B or less) that grew in
each half whoever made them, and the threads at both ends. Not a test: a leak shows as a
site whose growth keeps rising with ``--minutes``.

Beside the sites, every 10 s it samples where the process's memory is, by layer: its RSS by kind of
mapping (``/proc/self/smaps``, as the soak splits it: :data:`bench.soak.MAPPINGS`), glibc
malloc's bytes in use, free but kept, and mmapped (``mallinfo2``), and pymalloc's arenas and the
bytes in their allocated and available blocks (``sys._debugmallocstats``). Each is reported after
warm-up, half-way, at the end and after a ``malloc_trim(0)``. RSS that grows while the bytes in
use stay flat is the allocators keeping freed memory (fragmentation), not a leak; ``--no-trace``
leaves tracemalloc off, whose own bookkeeping would otherwise grow with every allocation it
follows. For the object types that grew most it says who holds a sample of those born after
warm-up. The fakes' own records (the fake dockerd's of every request, the fake kernel's of every
sysfs write) are trimmed as it goes: they are kept for the unit tests to read, and would otherwise
be what grows.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.soak import CATALOG, CONFIG, FAULTS, MAPPINGS, PUT, VBAR, VBAR_IMAGE, Doc
from harness.mds_emulator import ENABLE_GUEST_ATTRIBUTES
from tests.unit.fakes.dockerd import fake_dockerd
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.containers import engine_of
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tests.unit.helpers.runproc import free_port
from tpuboot.config import parse_config
from tpuboot.notify import Notifier
from tpuboot.paths import Root

REPO = Path(__file__).resolve().parent.parent
STDLIB = re.compile(r"^/.*/lib/python3\.\d+/")
COLD = ("0000:00:04.0", "0000:00:05.0")
HOT = ("0000:00:06.0", "0000:00:07.0", "0000:00:08.0", "0000:00:09.0")
FRAMES = 12  # enough to reach a tpuboot frame under requests and http.client
STOP_TIMEOUT_S = 30.0  # the emulator's own stop: its server's shutdown, at most one poll interval
KEEP_RECORDS = 100  # of each of the fakes' records of requests (see Driver.forget)


class QuietNotifier(Notifier):
    """sd_notify into nothing, as if systemd listened (WATCHDOG=1 and STATUS= cost what they cost)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def _send(self, text: str) -> None:
        pass


class Monitor:
    """A udev monitor fed by the driver (the tests' QueueMonitor, without a record of events)."""

    def __init__(self) -> None:
        self.rx, self.tx = socket.socketpair()
        self.rx.setblocking(False)
        self.events: collections.deque[tuple[str, str, str]] = collections.deque()

    def fileno(self) -> int:
        return self.rx.fileno()

    def push(self, action: str, name: str) -> None:
        self.events.append((action, "pci", name))
        self.tx.send(b"x")

    def poll(self, timeout: float | None = None) -> Any:
        try:
            self.rx.recv(1)
        except BlockingIOError:
            return None
        action, subsystem, name = self.events.popleft()
        return argparse.Namespace(action=action, subsystem=subsystem, sys_name=name)


def config_text(mds_host: str, metrics_port: int, vbar_port: int) -> str:
    """The soak guest's configuration, with this process's emulator, metrics port and vBar endpoint."""
    import yaml

    data = yaml.safe_load(CONFIG)
    data.pop("devices", None)  # the fake kernel's chips are v5p, which the default table knows
    data["metadata"] = {**data.get("metadata", {}), "host": mds_host, "timeout": 2.0}
    data["metrics"] = {"port": metrics_port}
    data["vbar"] = {**data["vbar"], "endpoint": f"127.0.0.1:{vbar_port}"}
    data["gke"] = "false"
    return yaml.safe_dump(data)


class Driver:
    """The soak's moves, at a pace of ``pace`` seconds between them."""

    def __init__(self, kernel: FakeKernel, monitor: Monitor, mds: EmulatorProcess, dockerd: Any, seed: int):
        self.kernel, self.monitor, self.mds, self.dockerd = kernel, monitor, mds, dockerd
        self.rng = random.Random(seed)
        self.hot: list[str] = []
        self.fault_until = 0.0
        self.fault: str | None = None
        self.moves: collections.Counter[str] = collections.Counter()
        self.catalog: tuple[Doc, ...] = CATALOG

    def step(self) -> None:
        now = time.monotonic()
        if self.fault is not None and now >= self.fault_until:
            self.clear_fault()
        moves: list[tuple[str, int, Callable[[], None]]] = [
            ("hotplug add", 30, self.hot_add),
            ("hotplug remove", 28, self.hot_remove),
            ("metadata fault", 12, self.start_fault),
            ("tpu-env document", 14, self.document),
            ("vBar kill", 5, self.kill_vbar),
            ("dockerd restart", 3, self.restart_dockerd),
        ]
        name, _, move = self.rng.choices(moves, weights=[w for _, w, _ in moves])[0]
        self.moves[name] += 1
        move()
        self.forget()

    def forget(self) -> None:
        """Trim the fakes' records (kept for the unit tests to read): the fake dockerd's of every
        request (one Request with its Event per Docker API call) and the fake kernel's of every
        sysfs write (four per bind). Left whole, they are what grows most in this process, and
        they are not tpuboot's."""
        with self.dockerd.lock:
            del self.dockerd.requests[:-KEEP_RECORDS]
            del self.dockerd.pulls[:-KEEP_RECORDS]
            del self.dockerd.pull_auths[:-KEEP_RECORDS]
        del self.kernel.writes[:-KEEP_RECORDS]
        del self.kernel.faults.hits[:-KEEP_RECORDS]

    def hot_add(self) -> None:
        free = [a for a in HOT if a not in self.hot]
        if not free:
            return
        address = self.rng.choice(free)
        add_tpu(self.kernel, address, V5P, driver=None, group=str(10 + HOT.index(address)))
        self.hot.append(address)
        self.monitor.push("add", address)

    def hot_remove(self) -> None:
        if not self.hot:
            return
        address = self.hot.pop(self.rng.randrange(len(self.hot)))
        device = self.kernel.p(f"/sys/bus/pci/devices/{address}")
        while device.exists():  # the daemon may be writing in it (a bind): as the kernel, remove all
            shutil.rmtree(device, ignore_errors=True)
        group = str(10 + HOT.index(address))
        self.kernel.p(f"/sys/kernel/iommu_groups/{group}/devices/{address}").unlink()
        self.kernel.p(f"/dev/vfio/{group}").unlink(missing_ok=True)
        self.monitor.push("remove", address)

    def start_fault(self) -> None:
        if self.fault is not None:
            return
        self.fault = self.rng.choice(sorted(FAULTS))
        fields = FAULTS[self.fault]
        if fields is None:
            self.mds.stop()
        else:
            self.mds.set_faults(**fields)
        self.fault_until = time.monotonic() + self.rng.uniform(1.0, 6.0)

    def clear_fault(self) -> None:
        if FAULTS[self.fault or ""] is None:
            self.mds.restart()
        self.mds.set_faults()
        self.fault = None

    def document(self) -> None:
        if self.fault == "down":
            return
        doc = self.rng.choice(self.catalog)
        self.mds.serve(doc)

    def kill_vbar(self) -> None:
        if VBAR in self.dockerd.containers and self.dockerd.containers[VBAR]["State"]["Running"]:
            self.dockerd.die(VBAR, 137)

    def restart_dockerd(self) -> None:
        self.dockerd.stop()
        with self.dockerd.lock:  # every event stream was cut: the fake's list of them need not keep them
            self.dockerd.subscribers.clear()
        self.dockerd.start()


class EmulatorProcess:
    """The metadata emulator in a process of its own, as in the soak's guest: its threads and its
    answers' buffers (the 1 MiB document's) are not this process's memory. Documents are put to it
    as the soak puts them (``bench.soak.PUT``, the padding added by that process, not this one)."""

    def __init__(self, first: Doc, work: Path) -> None:
        self.port = free_port()
        self.attributes = work / "attributes.yaml"
        self.attributes.write_text(json.dumps({"tpu-env": first.text, ENABLE_GUEST_ATTRIBUTES: "TRUE"}))
        self.served = first
        self.process: subprocess.Popen[str] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EmulatorProcess:
        script = REPO / "harness" / "mds_emulator.py"
        argv = [sys.executable, str(script), "--port", str(self.port), "--attributes", str(self.attributes)]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "metadata emulator listening on ...": it is up
        return self

    def put(self, path: str, body: str, pad: int = 0) -> None:
        url = f"http://{self.host}/_emulator/{path}"
        subprocess.run([sys.executable, "-c", PUT, url, str(pad)], input=body.encode(), capture_output=True,
                       check=True)  # fmt: skip

    def serve(self, doc: Doc) -> None:
        self.put("v1/instance/attributes/tpu-env", doc.text, doc.pad)
        self.served = doc

    def set_faults(self, **fields: Any) -> None:
        self.put("faults", json.dumps(fields))

    def stop(self) -> None:
        """Down: connection refused until :meth:`restart`."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.communicate(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # a bug of the emulator's: the bench goes on, loudly
                print(f"memgrowth: the emulator outlived SIGTERM by {STOP_TIMEOUT_S:g} s", file=sys.stderr)
                self.process.kill()
                self.process.communicate()
            self.process = None

    def restart(self) -> None:
        self.start()
        self.serve(self.served)  # it starts from its attributes file: serve again what was served

    def close(self) -> None:
        self.stop()


def listen_and_close(port: int, stop: threading.Event) -> None:
    """vBar's endpoint: accepts each probe and closes it."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(16)
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()


def snapshot() -> tracemalloc.Snapshot | None:
    return tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None


def type_counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def owner(referrer: object, skip: set[int]) -> str:
    """What holds an object through ``referrer``: the class of the instance whose ``__dict__`` it
    is, the function a frame or cell is of, else the referrer's own type (module.qualname)."""
    if isinstance(referrer, dict):
        for outer in gc.get_referrers(referrer):
            if id(outer) not in skip and getattr(outer, "__dict__", None) is referrer:
                return f"{type(outer).__module__}.{type(outer).__qualname__}"
    if isinstance(referrer, types.FrameType):
        return f"frame {referrer.f_code.co_filename.split('/')[-1]}:{referrer.f_code.co_name}"
    return f"{type(referrer).__module__}.{type(referrer).__qualname__}"


def holders(
    before: set[int], grown: collections.Counter[str], top: int = 8, sample: int = 40
) -> dict[str, Any]:
    """For the ``top`` types that grew most, who holds a ``sample`` of their objects born since
    ``before`` (the ids alive then): a leak shows as a holder that keeps its objects."""
    gc.collect()
    born: dict[str, list[object]] = collections.defaultdict(list)
    wanted = {name for name, _ in grown.most_common(top)}
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        if name in wanted and id(obj) not in before and len(born[name]) < sample:
            born[name].append(obj)
    skip = {id(born), *(id(objs) for objs in born.values()), id(sys._getframe())}
    found: dict[str, Any] = {}
    for name, objs in born.items():
        tally: collections.Counter[str] = collections.Counter()
        for obj in objs:
            for referrer in gc.get_referrers(obj):
                if id(referrer) not in skip and referrer is not objs:
                    tally[owner(referrer, skip | {id(objs)})] += 1
        found[name] = dict(tally.most_common(5))
    born.clear()
    return found


MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
MALLINFO2_FIELDS += ("fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): every field a size_t, summed over all arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def mallinfo() -> dict[str, int]:
    """glibc malloc's bytes in use, free but kept in its arenas, and in blocks of their own mmap."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks, "malloc_mmapped": info.hblkhd}


def smaps_by_kind(text: str) -> dict[str, int]:
    """RSS in KiB by :data:`bench.soak.MAPPINGS` kind, from a ``/proc/PID/smaps`` text: the split
    the soak's probe makes with awk in the guest."""
    kib = dict.fromkeys(MAPPINGS, 0)
    kind = "other"
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else ""
            kind = (
                "heap" if name == "[heap]" else "anon" if not name else "file" if name[0] == "/" else "other"
            )
        elif head and head[0] == "Rss:":
            kib[kind] += int(head[1])
    return {f"rss_{kind}_kib": value for kind, value in kib.items()}


PYMALLOC = {
    "# arenas allocated current": "pymalloc_arenas",
    "# bytes in allocated blocks": "pymalloc_allocated",
    "# bytes in available blocks": "pymalloc_available",
}


def pymalloc() -> dict[str, int]:
    """pymalloc's arenas now, and the bytes in their allocated and available blocks (the first of
    each line ``sys._debugmallocstats`` writes to the C stderr)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    found: dict[str, int] = {}
    for line in text.splitlines():
        label, _, value = line.partition("=")
        key = PYMALLOC.get(label.strip())
        if key is not None and key not in found:
            found[key] = int(value.strip().replace(",", ""))
    return found


def memory() -> dict[str, int]:
    """Where this process's memory is now, by layer (see the module's docstring)."""
    layers = smaps_by_kind(Path("/proc/self/smaps").read_text()) | mallinfo() | pymalloc()
    if tracemalloc.is_tracing():
        layers |= {
            "traced": tracemalloc.get_traced_memory()[0],
            "tracemalloc_own": tracemalloc.get_tracemalloc_memory(),
        }
    return layers


def growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int) -> list[str]:
    """The allocation sites with a tpuboot frame whose live size grew most (innermost frame first)."""
    ours = [
        tracemalloc.Filter(True, "*/tpuboot/*", all_frames=True),
        tracemalloc.Filter(False, "*/tests/*"),  # the fakes' own records (the fake kernel's writes)
        tracemalloc.Filter(False, "*/harness/*"),
    ]
    diff = after.filter_traces(ours).compare_to(before.filter_traces(ours), "traceback")
    lines = []
    for stat in diff[:top]:
        if stat.size_diff <= 0:
            continue
        lines.append(grown_line(stat.size_diff, stat.count_diff, stat.traceback))
    return lines


#: pymalloc serves requests up to this many bytes (CPython's SMALL_REQUEST_THRESHOLD); larger go
#: to glibc's malloc.
PYMALLOC_MAX_BLOCK = 512


def small_blocks_by_site(snapshot: tracemalloc.Snapshot) -> dict[tracemalloc.Traceback, tuple[int, int]]:
    """Live bytes and blocks of pymalloc's size (at most :data:`PYMALLOC_MAX_BLOCK`) by traceback."""
    sites: dict[tracemalloc.Traceback, tuple[int, int]] = {}
    for trace in snapshot.traces:
        if trace.size <= PYMALLOC_MAX_BLOCK:
            size, count = sites.get(trace.traceback, (0, 0))
            sites[trace.traceback] = (size + trace.size, count + 1)
    return sites


def small_block_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int) -> list[str]:
    """The sites of pymalloc's blocks whose live size grew most, whoever allocated them (tpuboot,
    a library, the fakes, the bench): the growth of pymalloc's arenas that no container object
    explains is strings, bytes and numbers, and these are where they were made."""
    then, now = small_blocks_by_site(before), small_blocks_by_site(after)
    grown = []
    for traceback, (size, count) in now.items():
        size_then, count_then = then.get(traceback, (0, 0))
        if size > size_then:
            grown.append((size - size_then, count - count_then, traceback))
    grown.sort(key=lambda g: -g[0])
    return [grown_line(size, count, traceback) for size, count, traceback in grown[:top]]


def grown_line(size: int, count: int, traceback: tracemalloc.Traceback) -> str:
    """One site's growth as the report prints it."""
    return f"{size:+9d} B {count:+6d} blocks  {site(traceback)}"


def site(traceback: tracemalloc.Traceback) -> str:
    """Its six innermost frames, innermost first, each ``file:line`` below the repository,
    site-packages or the standard library's folder."""
    frames = []
    for frame in traceback:
        name = frame.filename.removeprefix(f"{REPO}/").split("site-packages/")[-1]
        frames.append(f"{STDLIB.sub('', name)}:{frame.lineno}")
    return " < ".join(frames[-6:][::-1])


def large_document(size: int) -> Doc:
    """A good document of about ``size`` bytes (the sample and a comment): read whole, parsed, kept."""
    first = CATALOG[0]
    return Doc(
        f"sample with a comment to {size} bytes", first.text, first.expected, pad=size - len(first.text)
    )


@contextlib.contextmanager
def daemon_process(trace: bool) -> Iterator[None]:
    """The process as the bench's daemon wants it (a watchdog beat every 0.2 s, no notify socket,
    tracemalloc on if asked), put back after: a test runs the bench inside pytest's process, whose
    later tests would otherwise all serve with a watchdog."""
    saved = {name: os.environ.get(name) for name in ("WATCHDOG_USEC", "NOTIFY_SOCKET")}
    os.environ["WATCHDOG_USEC"] = "400000"  # a tick every 0.2 s
    os.environ.pop("NOTIFY_SOCKET", None)
    if trace:
        tracemalloc.start(FRAMES)
    try:
        yield
    finally:
        if trace:
            tracemalloc.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(
    minutes: float, warmup: float, pace: float, seed: int, trace: bool = True, large: int = 0
) -> dict[str, Any]:
    if warmup >= minutes * 60:
        raise ValueError("--minutes must be longer than --warmup")
    with daemon_process(trace):
        return measure(minutes, warmup, pace, seed, large)


def measure(minutes: float, warmup: float, pace: float, seed: int, large: int) -> dict[str, Any]:
    """:func:`run`'s work, in the process :func:`daemon_process` set up."""
    from tpuboot.wiring import build  # after tracemalloc starts, so the imports' allocations are seen

    work = Path(tempfile.mkdtemp(prefix="memgrowth-"))
    kernel = FakeKernel(work / "kernel")
    for n, address in enumerate(COLD):
        add_tpu(kernel, address, V5P, driver=None, group=str(4 + n))
    stop = threading.Event()
    vbar_port = free_port()
    threading.Thread(target=listen_and_close, args=(vbar_port, stop), daemon=True).start()
    first = CATALOG[0]
    mds = EmulatorProcess(first, work).start()
    with fake_dockerd() as dockerd:
        dockerd.images.add(VBAR_IMAGE)
        config = parse_config(config_text(mds.host, free_port(), vbar_port), "memgrowth")
        monitor = Monitor()
        daemon = build(
            Root(dockerd.root), config, binder=binder(kernel), monitor=monitor, notifier=QuietNotifier(),
            engine=engine_of(dockerd),
        )  # fmt: skip
        serving = threading.Thread(target=daemon.serve, kwargs={"signals": False}, name="daemon", daemon=True)
        serving.start()
        driver = Driver(kernel, monitor, mds, dockerd, seed)
        if large:
            driver.catalog = (*CATALOG, large_document(large))
        started = time.monotonic()
        base: tracemalloc.Snapshot | None = None
        mid: tracemalloc.Snapshot | None = None
        counts: collections.Counter[str] = collections.Counter()
        alive: set[int] = set()  # ids of the objects alive after warm-up
        threads_then: list[str] = []
        layers: list[tuple[float, dict[str, int]]] = []  # (seconds, memory()) every 10 s
        marks: dict[str, dict[str, int]] = {}  # memory() after warm-up, half-way, at the end
        # At least to the half-way mark, however slow the host: a short run's first move may come
        # after its end.
        while time.monotonic() - started < minutes * 60 or "half-way" not in marks:
            driver.step()
            time.sleep(pace)
            now = time.monotonic() - started
            if "after warm-up" not in marks and now >= warmup:
                base, counts = snapshot(), type_counts()
                alive = {id(o) for o in gc.get_objects()}
                threads_then = sorted(t.name for t in threading.enumerate())
                marks["after warm-up"] = memory()  # after the bench's own record of what is alive
            if "half-way" not in marks and now >= (warmup + minutes * 60) / 2:
                marks["half-way"] = memory()
                mid = snapshot()
            if not layers or now - layers[-1][0] >= 10:
                layers.append((round(now, 1), memory()))
        if driver.fault is not None:
            driver.clear_fault()
        marks["at the end"] = memory()
        end, counts_end = snapshot(), type_counts()
        grown = collections.Counter({k: counts_end[k] - counts[k] for k in counts_end})
        held = holders(alive, grown)
        ctypes.CDLL(None).malloc_trim(0)  # what of malloc's free memory it can give back
        marks["after malloc_trim(0)"] = memory()
        threads_end = sorted(t.name for t in threading.enumerate())
        daemon.request_stop()
        serving.join(30)
        stop.set()
        mds.close()
    grew = {k: counts_end[k] - counts[k] for k in counts_end if counts_end[k] - counts[k] > 0}
    sites: dict[str, list[str]] = {}
    if base is not None and mid is not None and end is not None:
        sites = {
            "sites_first_half": growth(base, mid, 15),
            "sites_second_half": growth(mid, end, 15),
            "sites": growth(base, end, 25),
            "small_blocks_first_half": small_block_growth(base, mid, 15),
            "small_blocks_second_half": small_block_growth(mid, end, 15),
        }
    return {
        "minutes": minutes,
        "warmup_s": warmup,
        "moves": dict(driver.moves),
        "memory_by_layer": {key: [m[key] for m in marks.values()] for key in marks["at the end"]},
        "memory_marks": list(marks),
        "memory_every_10s": layers,
        **sites,
        "types_grown": dict(sorted(grew.items(), key=lambda kv: -kv[1])[:25]),
        "types_grown_held_by": held,
        "threads_after_warmup": threads_then,
        "threads_at_end": threads_end,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memgrowth", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the first snapshot")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds between moves")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument(
        "--no-trace", action="store_true", help="no tracemalloc: the layers alone, unperturbed"
    )
    parser.add_argument(
        "--large-document",
        type=int,
        default=0,
        metavar="BYTES",
        help="also serve a good tpu-env document of this size (under metadata.max_body: read whole)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    if args.warmup >= args.minutes * 60:
        parser.error("--minutes must be longer than --warmup")
    result = run(
        args.minutes, args.warmup, args.pace, args.seed, trace=not args.no_trace, large=args.large_document
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
