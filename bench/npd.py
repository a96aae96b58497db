"""What one node-problem-detector rule costs: `tpuboot npd CONDITION` end to end (process start
to exit, as NPD runs it every 30 s on every node), each rule of :data:`tpuboot.checks.npd.CONDITIONS`,
against NPD's 5 s timeout (on the host, no guest).

As bench/holders.py does, the bench runs itself again in a private mount namespace
(``unshare -m``) with a stand-in sysfs (one v5p function bound to vfio-pci) bind-mounted over
/sys/bus/pci and /sys/kernel/iommu_groups, so each rule runs without ``--root`` as on a TPU host:
the host's real /proc (``--processes`` extra processes of ``--files`` open files each, the holders
scan's work), systemctl for the daemon, dockerd's socket. ``--load N`` keeps N busy processes
running meanwhile (default 2: both cores of this project's machines). The configuration says
``gke: false``, and ``$GCE_METADATA_HOST`` points at a closed loopback port, so nothing leaves the
host. Each rule runs ``--runs`` times after one warm-up; the table gives the median and the
slowest, and their ratio to NPD's timeout. Goal: the median at most a tenth of it.

    sudo .venv/bin/python -m bench.npd [--runs 15] [--load 2] [--processes 500] [--files 10]

Run as root (mount, and the /dev node the crowd holds). Benchmarks print figures; they are not
assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.holders import DBDF, crowd, mount_stand_in, stand_in_tree
from tpuboot.checks import npd

REPO = Path(__file__).resolve().parent.parent
NPD_TIMEOUT = 5.0  # s, NPD's default and the shipped configs' pluginConfig timeout
GOAL = 0.1  # median / NPD_TIMEOUT


@contextlib.contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes spinning on a core each, ended on the way out whatever happens."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def measure(runs: int, config: str) -> dict[str, dict[str, object]]:
    """Each rule's wall times (s), exit statuses and last line, rule after rule in rounds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GCE_METADATA_HOST": "127.0.0.1:9"}
    found: dict[str, dict[str, object]] = {
        c.name: {"seconds": [], "statuses": [], "line": ""} for c in npd.CONDITIONS
    }
    for round_ in range(runs + 1):  # round 0 warms the page cache and is not counted
        for name, entry in found.items():
            argv = [sys.executable, "-m", "tpuboot", "--config", config, "npd", name]
            started = time.perf_counter()
            done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=60)
            elapsed = time.perf_counter() - started
            if round_:
                entry["seconds"].append(elapsed)  # type: ignore[attr-defined]
                entry["statuses"].append(done.returncode)  # type: ignore[attr-defined]
            entry["line"] = done.stdout.strip()
    return found


def inside(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """In the namespace: the stand-in sysfs mounted, the crowd and the load running, the rules timed."""
    with tempfile.TemporaryDirectory(prefix="tpuboot-bench-npd-") as top:
        tree = stand_in_tree(Path(top))
        # Config space that answers (Google's vendor id), so the PCIe rule judges a present chip.
        (tree / "sys/bus/pci/devices" / DBDF / "config").write_bytes(b"\xe0\x1a\x62\x00" + bytes(60))
        mount_stand_in(tree)
        config = Path(top) / "tpuboot.yaml"
        config.write_text("gke: 'false'\n")
        with crowd(args.processes, args.files), busy(args.load):
            return measure(args.runs, str(config))


def report(found: dict[str, dict[str, object]], args: argparse.Namespace) -> list[str]:
    lines = [
        f"npd rules: {args.runs} runs each, {args.load} busy processes, {args.processes} extra "
        f"processes x {args.files} files; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        f"{'rule':<12} {'median':>8} {'max':>8} {'median/5s':>10} {'max/5s':>7}  exit  last line",
    ]
    worst = 0.0
    for name, entry in found.items():
        seconds: list[float] = entry["seconds"]  # type: ignore[assignment]
        med, top = statistics.median(seconds), max(seconds)
        worst = max(worst, med / NPD_TIMEOUT)
        statuses = ",".join(str(s) for s in sorted(set(entry["statuses"])))  # type: ignore[call-overload]
        lines.append(
            f"{name:<12} {med * 1000:>6.0f}ms {top * 1000:>6.0f}ms {med / NPD_TIMEOUT:>10.3f} "
            f"{top / NPD_TIMEOUT:>7.3f}  {statuses:<4}  {entry['line']}"
        )
    verdict = "PASS" if worst <= GOAL else "FAIL"
    lines.append(f"goal: every rule's median <= {GOAL:g} of NPD's {NPD_TIMEOUT:g} s timeout: {verdict}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.npd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--load", type=int, default=2, help="busy processes meanwhile (default 2)")
    parser.add_argument("--processes", type=int, default=500)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the namespace
    args = parser.parse_args(argv)
    if args.inside:
        print(json.dumps(inside(args)))
        return 0
    again = ["unshare", "-m", "--propagation", "private", sys.executable, "-m", "bench.npd", "--inside"]
    again += ["--runs", str(args.runs), "--load", str(args.load)]
    again += ["--processes", str(args.processes), "--files", str(args.files)]
    done = subprocess.run(again, capture_output=True, text=True, check=True, cwd=REPO)
    print("\n".join(report(json.loads(done.stdout.splitlines()[-1]), args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
