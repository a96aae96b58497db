"""`tpuboot who` against `fuser -v` and `lsof` on the same node, on a host with about 2,000
processes of 50 open files each, all three side by side in one run (on the host, no guest).

The bench makes the crowd itself: 2,000 forked processes (``--processes``), each with 50 files
of a scratch directory open (``--files``), three of them also holding the node; it ends them
all (and removes the node and the scratch files) whatever happens. This host has no TPU: the
bench runs itself again in a private mount namespace (``unshare -m``) where a stand-in sysfs
(one v5p function bound to vfio-pci in IOMMU group ``GROUP``) is bind-mounted over
/sys/bus/pci and /sys/kernel/iommu_groups, and the node is a character device at
``/dev/vfio/<group>`` with /dev/full's number (a real group node needs vfio-pci; tpuboot matches a
node by its number, and nothing else on the host holds /dev/full); `tpuboot who` then runs as on
a TPU host, without ``--root``, on the host's real /proc. Each tool runs ``--runs`` times in turn
(ABC ABC ...)
after one warm-up round; the table gives medians and ratios (tpuboot / the tool). Goal: at
most fuser's time. Every tool must name the same three holders, or the bench says so.

    sudo .venv/bin/python -m bench.holders [--processes 2000] [--files 50] [--runs 7]

Run as root (the node goes in /dev, fuser and lsof see every process). Benchmarks print figures;
they are not assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.table import Report, Row, safe_ratio

REPO = Path(__file__).resolve().parent.parent
GROUP = "9009"
NODE = f"/dev/vfio/{GROUP}"
DBDF = "0000:00:04.0"
HOLDERS = 3
GOAL = 1.0  # tpuboot / fuser


@dataclass
class Timing:
    """One tool's runs: wall-clock seconds, and CPU seconds (user + system, its own and its
    children's), which the other work of a shared host does not inflate."""

    name: str
    seconds: list[float]
    cpu: list[float]
    pids: set[int]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def stand_in_tree(top: Path) -> Path:
    """A sysfs tree with one v5p function bound to vfio-pci in GROUP, for bind mounts over the host's."""
    device = top / "sys/bus/pci/devices" / DBDF
    device.mkdir(parents=True)
    (device / "uevent").write_text(f"PCI_ID=1AE0:0062\nPCI_SUBSYS_ID=1AE0:00AD\nPCI_SLOT_NAME={DBDF}\n")
    (top / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True)
    (top / "sys/kernel/iommu_groups" / GROUP / "devices").mkdir(parents=True)
    members = top / "sys/kernel/iommu_groups" / GROUP / "devices"
    os.symlink(f"../../../../bus/pci/devices/{DBDF}", members / DBDF)
    os.symlink(f"../../../kernel/iommu_groups/{GROUP}", device / "iommu_group")
    os.symlink("../../../bus/pci/drivers/vfio-pci", device / "driver")
    return top


def mount_stand_in(top: Path) -> None:
    """Over this namespace's sysfs: the stand-in's PCI devices and IOMMU groups."""
    for where in ("/sys/bus/pci", "/sys/kernel/iommu_groups"):
        subprocess.run(["mount", "--bind", str(top) + where, where], check=True)


def _child(paths: Sequence[str], hold: bool) -> None:
    """In the fork: the files open, then wait for SIGKILL (no exec: the fds stay as opened)."""
    for path in paths:
        os.open(path, os.O_RDONLY)
    if hold:
        os.open(NODE, os.O_RDONLY)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    while True:
        signal.pause()


@contextlib.contextmanager
def crowd(processes: int, files: int) -> Iterator[set[int]]:
    """``processes`` processes of ``files`` open files each; the PIDs of the HOLDERS that hold NODE."""
    scratch = Path(tempfile.mkdtemp(prefix="tpuboot-bench-holders-"))
    made_vfio = not os.path.isdir("/dev/vfio")
    os.makedirs("/dev/vfio", exist_ok=True)
    os.mknod(NODE, 0o600 | stat.S_IFCHR, os.stat("/dev/full").st_rdev)
    paths = []
    for n in range(files):
        path = scratch / f"f{n}"
        path.write_text("x")
        paths.append(str(path))
    pids: list[int] = []
    holders: set[int] = set()
    try:
        for n in range(processes):
            hold = n % (processes // HOLDERS) == 0 and len(holders) < HOLDERS
            pid = os.fork()
            if pid == 0:
                try:
                    _child(paths, hold)
                finally:
                    os._exit(0)
            pids.append(pid)
            if hold:
                holders.add(pid)
        time.sleep(1.0)  # let the last forks open their files
        yield holders
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os.unlink(NODE)
        if made_vfio:
            os.rmdir("/dev/vfio")
        shutil.rmtree(scratch)


def commands() -> dict[str, list[str]]:
    tpuboot = [sys.executable, "-m", "tpuboot", "who"]
    return {"tpuboot who": tpuboot, "fuser -v": ["fuser", "-v", NODE], "lsof": ["lsof", "-w", NODE]}


def pids_named(name: str, out: str) -> set[int]:
    """The holder PIDs each tool printed on stdout (fuser prints them alone there, the rest on stderr)."""
    found: set[int] = set()
    for line in out.splitlines():
        words = line.split()
        ours = name == "tpuboot who" and line.strip().startswith("PID ")
        if ours or (name == "lsof" and len(words) > 1 and words[1].isdigit()):
            found.add(int(words[1]))
        elif name == "fuser -v":
            found |= {int(w) for w in words if w.isdigit()}
    return found


def measure(argvs: dict[str, list[str]], runs: int) -> dict[str, Timing]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    timings = {name: Timing(name, [], [], set()) for name in argvs}
    for round_ in range(runs + 1):  # round 0 warms the page cache and is not counted
        for name, argv in argvs.items():
            before = _children_cpu()
            started = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            elapsed = time.perf_counter() - started
            if round_:
                timings[name].seconds.append(elapsed)
                timings[name].cpu.append(_children_cpu() - before)
            timings[name].pids = pids_named(name, done.stdout)
    return timings


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def report(timings: dict[str, Timing], holders: set[int], processes: int, files: int) -> list[str]:
    fuser, lsof = timings["fuser -v"], timings["lsof"]
    lines = [f"holders: {processes} processes x {files} open files, {HOLDERS} holding {NODE}"]
    lines.append(f"{os.cpu_count()} cores; {os.getloadavg()[0]:.1f} load average at the end")
    heads = " ".join(f"{h:>8}" for h in ("wall", "min", "max", "cpu"))
    lines.append(f"{'tool':<12} {heads}  {'vs fuser':>14} {'vs lsof':>14}  holders named")
    for t in timings.values():
        right = "all" if t.pids >= holders else f"MISSING {sorted(holders - t.pids)}"
        vs = [f"{t.median / o.median:.2f}x/{t.cpu_median / o.cpu_median:.2f}x" for o in (fuser, lsof)]
        lines.append(
            f"{t.name:<12} {ms(t.median)} {ms(min(t.seconds))} {ms(max(t.seconds))} {ms(t.cpu_median)}"
            f"  {vs[0]:>14} {vs[1]:>14}  {right}"
        )
    lines.append("(medians; ratios wall/cpu, tpuboot or the tool over fuser or lsof)")
    ours = timings["tpuboot who"]
    for what, a, b in (("wall", ours.median, fuser.median), ("cpu", ours.cpu_median, fuser.cpu_median)):
        verdict = "PASS" if a / b <= GOAL else "FAIL"
        lines.append(f"goal: tpuboot who <= {GOAL:g}x fuser's {what} time: {verdict} ({a / b:.2f}x)")
    return lines


def ms(seconds: float) -> str:
    return f"{seconds * 1000:>6.0f}ms"


def measure_crowd(
    processes: int = 2000, files: int = 50, runs: int = 7
) -> tuple[dict[str, Timing], set[int]]:
    """Each tool's timings in the crowd, and the PIDs of the holders it should name."""
    for tool in ("fuser", "lsof"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench.holders: {tool} not found (Debian: apt install psmisc lsof)")
    with tempfile.TemporaryDirectory(prefix="tpuboot-bench-sys-") as top:
        mount_stand_in(stand_in_tree(Path(top)))
        with crowd(processes, files) as holders:
            return measure(commands(), runs), holders


def in_namespace(processes: int = 2000, files: int = 50, runs: int = 7) -> tuple[dict[str, Timing], set[int]]:
    """:func:`measure_crowd` in a private mount namespace (the bench itself again, under unshare)."""
    argv = ["unshare", "-m", "--propagation", "private", sys.executable, "-m", "bench.holders", "--inside"]
    argv += ["--processes", str(processes), "--files", str(files), "--runs", str(runs), "--raw"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO)
    data = json.loads(done.stdout.splitlines()[-1])
    timings = {
        name: Timing(name, t["seconds"], t["cpu"], set(t["pids"])) for name, t in data["timings"].items()
    }
    return timings, set(data["holders"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.holders", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the namespace
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)  # JSON for in_namespace
    args = parser.parse_args(argv)
    if not args.inside:
        timings, holders = in_namespace(args.processes, args.files, args.runs)
    else:
        timings, holders = measure_crowd(args.processes, args.files, args.runs)
    if args.raw:
        data = {
            name: {"seconds": t.seconds, "cpu": t.cpu, "pids": sorted(t.pids)} for name, t in timings.items()
        }
        print(json.dumps({"timings": data, "holders": sorted(holders)}))
    else:
        print("\n".join(report(timings, holders, args.processes, args.files)))
    return 0


def run_family(report: Report) -> None:
    """bench/holders.py: `tpuboot who` against fuser (the baseline) and lsof (the peer)."""
    timings, named = in_namespace()
    ours, fuser, lsof = (timings[name] for name in ("tpuboot who", "fuser -v", "lsof"))
    for what, pick in (("wall", lambda t: t.median), ("cpu", lambda t: t.cpu_median)):
        ratio = safe_ratio(pick(ours), pick(fuser))
        verdict = "PASS" if ratio is not None and ratio <= GOAL else "FAIL"
        row = Row(
            f"who on 2000 processes x 50 files: {what} time (baseline fuser -v)",
            f"{pick(ours) * 1000:.0f} ms",
            f"{pick(fuser) * 1000:.0f} ms",
            ratio,
            f"<= {GOAL:g}x",
            verdict,
        )
        peer = f"{pick(lsof) * 1000:.0f} ms"
        report.add("holders", row.against("lsof", peer, safe_ratio(pick(ours), pick(lsof))))
    missing = {t.name: sorted(named - t.pids) for t in timings.values() if not t.pids >= named}
    said = f"every tool named the {len(named)} holders" if not missing else f"missed: {missing}"
    report.note("holders", said)


if __name__ == "__main__":
    sys.exit(main())
