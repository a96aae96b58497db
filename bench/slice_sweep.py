"""`tpuboot slice`'s peer sweep against a serial sweep, and `wait-slice` seeing a firewall fixed, on
a real network stack (issue 34, item 6). No guest: network namespaces on the host.

The slice is tests/unit/slice/slicenet.py's: namespace 0 is this worker (127.10.0.1), and the 64
peers are 64 addresses on the one interface of namespace 1 (127.10.0.2 to 127.10.0.65; 64
namespaces would cost 64 metadata-less namespaces for nothing the kernel does differently per
address). Nothing listens on the peers, so a connect is refused at once (the path is open), as
before a job; nftables in namespace 1 drops the three ports (8471, 8476, 8482) of one peer.

- **sweep**: the 192 paths through :func:`tpuboot.slice.sweep.sweep` (each connect within
  ``--connect-timeout``, 2 s as the command's default) against a serial sweep of the same paths in
  the same run: the documented way (a bash loop of ``timeout 2 bash -c '</dev/tcp/IP/PORT'``,
  one connect after another) and the same loop in Python (``socket.create_connection``, no
  forks). The ratios are what the table gives; the parallel sweep costs about one connect timeout
  whatever the number of peers, a serial one a timeout per dropped path. With every peer's three
  ports dropped (a firewall rule that lets none of the slice's ports through), the serial sweep
  costs 192 timeouts: that case runs with a short timeout (``--all-dropped-timeout``, 0.25 s).
- **wait-slice**: `tpuboot wait-slice` (``--interval`` 1 s, its default) on worker 63 of a v4-512
  (64 hosts) whose peer 0 drops 8471; once it has said what it waits for, ``nft delete table``
  removes the rule, and the bench times from the delete to its exit 0, in intervals. A look
  under way when the rule goes may still see the drop (it waits out its connect timeout), so the
  bound is one interval plus one connect timeout plus a look.

    sudo .venv/bin/python -m bench.slice_sweep [--reps 5] [--connect-timeout 2] [--wait-reps 3]

Root (namespaces, nft). Benchmarks print figures; they are not assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.table import Report, Row, safe_ratio
from tests.unit.slice.slicenet import AVAILABLE, WHY_NOT, SliceNet, ip
from tpuboot.slice.sweep import STATES, Target, sweep

REPO = Path(__file__).resolve().parent.parent
PEERS = 64
PORTS = (8471, 8476, 8482)
DROPPED_PEER = 5  # its three ports dropped
GOAL = 1.5  # the parallel sweep in connect timeouts
MACHINE = "projects/1/machineTypes/ct4p-hightpu-4t"


def peer_address(n: int) -> str:
    return f"127.10.0.{n + 2}"


def drop_rule(addresses: Sequence[str] | None) -> str:
    """nftables input rules dropping the slice's ports: of ``addresses``, or of every address."""
    ports = ", ".join(map(str, PORTS))
    match = f"ip daddr {{ {', '.join(addresses)} }} " if addresses else ""
    return (
        "table inet slicetest {\n chain input {\n  type filter hook input priority 0; policy accept;\n"
        f"  {match}tcp dport {{ {ports} }} drop\n }}\n}}\n"
    )


def peer_slice(tmp: Path) -> SliceNet:
    """This worker in namespace 0, the 64 peers on namespace 1's interface."""
    net = SliceNet(tmp, 2)
    for n in range(1, PEERS):  # peer 0 is the namespace's own address, 127.10.0.2
        ip("-n", net.names[1], "addr", "add", f"{peer_address(n)}/24", "dev", "eth0")
    return net


# --- inside namespace 0 ----------------------------------------------------------------------------


def targets() -> list[Target]:
    return [Target(n, peer_address(n), port, "bench") for n in range(PEERS) for port in PORTS]


def parallel(timeout: float) -> tuple[float, dict[str, int]]:
    start = time.monotonic()
    outcomes = sweep(targets(), connect_timeout=timeout, deadline_s=timeout * 10)
    took = time.monotonic() - start
    return took, {state: sum(o.state == state for o in outcomes) for state in STATES}


def serial_python(timeout: float) -> float:
    start = time.monotonic()
    for t in targets():
        with contextlib.suppress(OSError):  # refused or timed out: the state is not the point here
            socket.create_connection((t.address, t.port), timeout=timeout).close()
    return time.monotonic() - start


def serial_bash(timeout: float) -> float:
    """The documented check, one path after another: ``timeout T bash -c '</dev/tcp/IP/PORT'``."""
    paths = " ".join(f"{t.address}/{t.port}" for t in targets())
    script = f'for p in {paths}; do timeout {timeout:g} bash -c "</dev/tcp/$p" 2>/dev/null; done; true'
    start = time.monotonic()
    subprocess.run(["bash", "-c", script], check=True)
    return time.monotonic() - start


def inside(kind: str, timeout: float) -> dict[str, object]:
    if kind == "parallel":
        took, states = parallel(timeout)
        return {"seconds": took, "states": states}
    return {"seconds": serial_python(timeout) if kind == "python" else serial_bash(timeout)}


# --- from the host ---------------------------------------------------------------------------------


def in_worker(net: SliceNet, kind: str, timeout: float) -> dict[str, object]:
    argv = [sys.executable, "-m", "bench.slice_sweep", "--inside", kind, "--connect-timeout", str(timeout)]
    done = net.run(0, argv, env=net.env(), cwd=REPO, timeout=3600)
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def measure_sweeps(net: SliceNet, timeout: float, reps: int) -> dict[str, list[float]]:
    """Each way's times (ABC ABC ...), one peer's ports dropped; the parallel sweep's states checked."""
    net.run(1, ["nft", "-f", "-"], input=drop_rule([peer_address(DROPPED_PEER)]))
    times: dict[str, list[float]] = {"parallel": [], "python": [], "bash": []}
    try:
        for _ in range(reps):
            for kind in times:
                result = in_worker(net, kind, timeout)
                times[kind].append(float(result["seconds"]))  # type: ignore[arg-type]
                if kind == "parallel" and result["states"] != {
                    **dict.fromkeys(STATES, 0),
                    "refused": len(targets()) - len(PORTS),
                    "dropped": len(PORTS),
                }:
                    raise SystemExit(f"bench.slice_sweep: the sweep saw {result['states']}")
    finally:
        net.undrop(1)
    return times


def measure_all_dropped(net: SliceNet, timeout: float) -> dict[str, float]:
    net.run(1, ["nft", "-f", "-"], input=drop_rule(None))
    try:
        return {kind: float(in_worker(net, kind, timeout)["seconds"]) for kind in ("parallel", "python")}  # type: ignore[arg-type]
    finally:
        net.undrop(1)


def wait_slice_config(net: SliceNet) -> None:
    """Worker 63 of a v4-512 (64 hosts): peers 0 to 62 on namespace 1, itself on namespace 0."""
    listed = [peer_address(n) for n in range(PEERS - 1)] + [net.address(0)]
    net.metadata(
        0,
        {"agent-worker-number": str(PEERS - 1), "worker-network-endpoints": net.endpoints(listed)},
        {"network-interfaces/0/ip": net.address(0), "machine-type": MACHINE},
    )
    net.config(
        0, {"ACCELERATOR_TYPE": "v4-512", "WORKER_ID": str(PEERS - 1), "CHIPS_PER_HOST_BOUNDS": "2,2,1"}
    )


def wait_once(net: SliceNet, interval: float, timeout: float) -> float:
    """Seconds from the rule's delete to `wait-slice` exiting 0."""
    net.run(1, ["nft", "-f", "-"], input=drop_rule([peer_address(0)]))
    args = ("--interval", f"{interval:g}", "--connect-timeout", f"{timeout:g}", "--timeout", "600")
    waiting = net.tpuboot_started(0, "wait-slice", *args)
    assert waiting.stderr is not None
    ready, _, _ = select.select([waiting.stderr], [], [], 600)
    line = waiting.stderr.readline() if ready else ""
    if "dropped" not in line:
        waiting.kill()
        raise SystemExit(f"bench.slice_sweep: wait-slice said {line!r}, not the drop")
    start = time.monotonic()
    net.undrop(1)
    waiting.wait(timeout=600)
    took = time.monotonic() - start
    if waiting.returncode != 0:
        raise SystemExit(f"bench.slice_sweep: wait-slice exited {waiting.returncode}")
    return took


def measure(reps: int, timeout: float, wait_reps: int, all_dropped_timeout: float) -> dict[str, object]:
    if not AVAILABLE:
        raise SystemExit(f"bench.slice_sweep: {WHY_NOT}")
    with tempfile.TemporaryDirectory(prefix="tpuboot-bench-slice-") as tmp:
        net = peer_slice(Path(tmp))
        try:
            sweeps = measure_sweeps(net, timeout, reps)
            everything = measure_all_dropped(net, all_dropped_timeout)
            wait_slice_config(net)
            interval = 1.0
            waits = [wait_once(net, interval, timeout) for _ in range(wait_reps)]
        finally:
            net.close()
    return {
        "connect_timeout": timeout,
        "sweeps": sweeps,
        "all_dropped_timeout": all_dropped_timeout,
        "all_dropped": everything,
        "interval": interval,
        "waits": waits,
    }


def lines(data: dict[str, object]) -> list[str]:
    timeout = float(data["connect_timeout"])  # type: ignore[arg-type]
    sweeps: dict[str, list[float]] = data["sweeps"]  # type: ignore[assignment]
    med = {kind: statistics.median(times) for kind, times in sweeps.items()}
    out = [
        f"{PEERS} peers x {len(PORTS)} ports, one peer's {len(PORTS)} ports dropped, "
        f"connect timeout {timeout:g} s (medians of {len(sweeps['parallel'])}):",
        f"  parallel sweep {med['parallel']:.2f} s ({med['parallel'] / timeout:.2f} connect timeouts)",
    ]
    for kind, name in (("python", "serial, Python"), ("bash", "serial, bash </dev/tcp loop")):
        out.append(f"  {name} {med[kind]:.2f} s: parallel / serial {med['parallel'] / med[kind]:.2f}x")
    t = float(data["all_dropped_timeout"])  # type: ignore[arg-type]
    every: dict[str, float] = data["all_dropped"]  # type: ignore[assignment]
    out.append(
        f"every port of every peer dropped, connect timeout {t:g} s: parallel {every['parallel']:.2f} s, "
        f"serial (Python) {every['python']:.2f} s: {every['parallel'] / every['python']:.3f}x"
    )
    interval = float(data["interval"])  # type: ignore[arg-type]
    waits: list[float] = data["waits"]  # type: ignore[assignment]
    shown = ", ".join(f"{w:.2f} s ({w / interval:.2f})" for w in waits)
    out.append(f"wait-slice, nft delete to exit 0, interval {interval:g} s: {shown} (in intervals)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slice_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--connect-timeout", type=float, default=2.0)
    parser.add_argument("--wait-reps", type=int, default=3)
    parser.add_argument("--all-dropped-timeout", type=float, default=0.25)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--inside", choices=("parallel", "python", "bash"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        print(json.dumps(inside(args.inside, args.connect_timeout)))
        return 0
    data = measure(args.reps, args.connect_timeout, args.wait_reps, args.all_dropped_timeout)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    print("\n".join(lines(data)))
    return 0


def run_family(report: Report) -> None:
    """bench/slice_sweep.py: the parallel sweep against the serial ones, and wait-slice's wake-up."""
    data = measure(5, 2.0, 3, 0.25)
    sweeps: dict[str, list[float]] = data["sweeps"]  # type: ignore[assignment]
    med = {kind: statistics.median(times) for kind, times in sweeps.items()}
    ratio = med["parallel"] / 2.0
    report.add(
        "slice",
        Row(
            f"sweep of {PEERS} peers x {len(PORTS)} ports, one peer dropped, in connect timeouts "
            "(baseline: serial bash)",
            f"{med['parallel']:.2f} s",
            f"{med['bash']:.2f} s",
            safe_ratio(med["parallel"], med["bash"]),
            f"<= {GOAL:g} timeouts",
            "PASS" if ratio <= GOAL else "FAIL",
        ).against("serial Python", f"{med['python']:.2f} s", safe_ratio(med["parallel"], med["python"])),
    )
    waits: list[float] = data["waits"]  # type: ignore[assignment]
    report.note("slice", "; ".join(lines(data)[-2:]))
    report.add("slice", Row("wait-slice: nft delete to exit 0 (s)", f"{statistics.median(waits):.2f} s", ""))


if __name__ == "__main__":
    sys.exit(main())
