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
object counts by type that grew, and the threads at both ends. Not a test: a leak shows as a
site whose growth keeps rising with ``--minutes``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.soak import CATALOG, CONFIG, FAULTS, VBAR, VBAR_IMAGE
from harness.mds_emulator import ENABLE_GUEST_ATTRIBUTES, MetadataEmulator
from tests.unit.fakes.dockerd import fake_dockerd
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tests.unit.helpers.runproc import free_port
from tpuboot.config import parse_config
from tpuboot.containers.dockerapi import DockerAPI
from tpuboot.notify import Notifier
from tpuboot.paths import Root

COLD = ("0000:00:04.0", "0000:00:05.0")
HOT = ("0000:00:06.0", "0000:00:07.0", "0000:00:08.0", "0000:00:09.0")
FRAMES = 12  # enough to reach a tpuboot frame under requests and http.client


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

    def __init__(self, kernel: FakeKernel, monitor: Monitor, mds: MetadataEmulator, dockerd: Any, seed: int):
        self.kernel, self.monitor, self.mds, self.dockerd = kernel, monitor, mds, dockerd
        self.rng = random.Random(seed)
        self.hot: list[str] = []
        self.fault_until = 0.0
        self.fault: str | None = None
        self.moves: collections.Counter[str] = collections.Counter()

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
        doc = self.rng.choice(CATALOG)
        self.mds.set_attribute("tpu-env", doc.text + "#" * doc.pad)

    def kill_vbar(self) -> None:
        if VBAR in self.dockerd.containers and self.dockerd.containers[VBAR]["State"]["Running"]:
            self.dockerd.die(VBAR, 137)

    def restart_dockerd(self) -> None:
        self.dockerd.stop()
        self.dockerd.start()


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


def type_counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


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
        frames = [
            f"{f.filename.split('/wt38/')[-1].split('site-packages/')[-1]}:{f.lineno}" for f in stat.traceback
        ]
        lines.append(f"{stat.size_diff:+9d} B {stat.count_diff:+6d} blocks  " + " < ".join(frames[-6:][::-1]))
    return lines


def run(minutes: float, warmup: float, pace: float, seed: int) -> dict[str, Any]:
    os.environ["WATCHDOG_USEC"] = "400000"  # a tick every 0.2 s
    os.environ.pop("NOTIFY_SOCKET", None)
    tracemalloc.start(FRAMES)
    from tpuboot.wiring import build  # after tracemalloc starts, so the imports' allocations are seen

    work = Path(tempfile.mkdtemp(prefix="memgrowth-"))
    kernel = FakeKernel(work / "kernel")
    for n, address in enumerate(COLD):
        add_tpu(kernel, address, V5P, driver=None, group=str(4 + n))
    stop = threading.Event()
    vbar_port = free_port()
    threading.Thread(target=listen_and_close, args=(vbar_port, stop), daemon=True).start()
    first = CATALOG[0]
    mds = MetadataEmulator({"tpu-env": first.text, ENABLE_GUEST_ATTRIBUTES: "TRUE"}).start()
    with fake_dockerd() as dockerd:
        dockerd.images.add(VBAR_IMAGE)
        config = parse_config(config_text(mds.host, free_port(), vbar_port), "memgrowth")
        monitor = Monitor()
        daemon = build(
            Root(dockerd.root), config, binder=binder(kernel), monitor=monitor, notifier=QuietNotifier(),
            docker=lambda: DockerAPI(str(dockerd.socket_path)),
        )  # fmt: skip
        serving = threading.Thread(target=daemon.serve, kwargs={"signals": False}, name="daemon", daemon=True)
        serving.start()
        driver = Driver(kernel, monitor, mds, dockerd, seed)
        started = time.monotonic()
        base: tracemalloc.Snapshot | None = None
        mid: tracemalloc.Snapshot | None = None
        counts: collections.Counter[str] = collections.Counter()
        threads_then: list[str] = []
        rss: list[tuple[float, int]] = []
        while time.monotonic() - started < minutes * 60:
            driver.step()
            time.sleep(pace)
            now = time.monotonic() - started
            if base is None and now >= warmup:
                base, counts = tracemalloc.take_snapshot(), type_counts()
                threads_then = sorted(t.name for t in threading.enumerate())
            if mid is None and now >= (warmup + minutes * 60) / 2:
                mid = tracemalloc.take_snapshot()
            if not rss or now - rss[-1][0] >= 10:
                rss.append((now, tracemalloc.get_traced_memory()[0]))
        if driver.fault is not None:
            driver.clear_fault()
        end, counts_end = tracemalloc.take_snapshot(), type_counts()
        threads_end = sorted(t.name for t in threading.enumerate())
        daemon.request_stop()
        serving.join(30)
        stop.set()
        mds.close()
    assert base is not None and mid is not None, "--minutes must be longer than --warmup"
    grew = {k: counts_end[k] - counts[k] for k in counts_end if counts_end[k] - counts[k] > 0}
    return {
        "minutes": minutes,
        "warmup_s": warmup,
        "moves": dict(driver.moves),
        "traced_bytes_every_10s": [b for _, b in rss],
        "sites_first_half": growth(base, mid, 15),
        "sites_second_half": growth(mid, end, 15),
        "sites": growth(base, end, 25),
        "types_grown": dict(sorted(grew.items(), key=lambda kv: -kv[1])[:25]),
        "threads_after_warmup": threads_then,
        "threads_at_end": threads_end,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memgrowth", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before the first snapshot")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds between moves")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--json", type=Path, metavar="FILE")
    args = parser.parse_args(argv)
    result = run(args.minutes, args.warmup, args.pace, args.seed)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
