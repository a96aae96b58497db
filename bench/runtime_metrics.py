"""Runtime metrics: what the collector of libtpu's metrics costs per poll and per hour, beside the
idle daemon's tick, and how long a hang takes from libtpu's gauge to the alert's metric (unit
level, no guest).

A stand-in job (harness/runtime_server.py in a process of its own, as a job's libtpu is) serves
``--devices`` devices on a loopback port; the collector (tpuboot/runtime/collector.py) polls it as
the daemon does, this process standing for the daemon. Cost per poll: the CPU time of this whole
process (the gRPC threads too) and the voluntary context switches of all its threads (each a
wake-up from a sleep), over ``--polls`` polls; per hour at GKE's pace (one poll per 10 s, 360). The
idle daemon's figure beside it: its tick (the unit's WatchdogSec=60: every 30 s, 120 an hour),
and what the collector adds to each tick on a TPU VM while no chip is held (the /proc scan of
`tpuboot who`, made here over this host's processes).

Latency: the poller thread at ``--interval`` (10 s); each of ``--rounds`` rounds turns the job's
hang gauge on (SIGUSR1) at a random phase of the poll cycle and times until the exported
``tpuboot_runtime_hang_detected`` reads 1 (read as a scrape reads it), then turns it off and waits
for 0. Its ratio to the interval: at most 1 plus a poll. The alert (no ``for:``) fires at
Prometheus's next scrape and rule evaluation after that, which this does not include.

    .venv/bin/python -m bench.runtime_metrics [--polls 200] [--rounds 6] [--interval 10] [--devices 8]

Benchmarks print figures; they are not assertions.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from tpuboot.config import Config, RuntimeMetricsConfig
from tpuboot.holders.procfs import ProcReader
from tpuboot.holders.report import gather
from tpuboot.metrics_export import RuntimeExport
from tpuboot.paths import Root
from tpuboot.runtime.collector import Holders, RuntimeCollector

REPO = Path(__file__).resolve().parents[1]
TICKS_PER_HOUR = 120  # WatchdogSec=60: WATCHDOG=1 every 30 s


def wakeups() -> int:
    """Voluntary context switches of every thread of this process so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_job(devices: int) -> tuple[subprocess.Popen[str], int]:
    """The stand-in job on a free loopback port: the process and the port."""
    job = subprocess.Popen(
        [sys.executable, str(REPO / "harness/runtime_server.py"), "--port", "0", "--devices", str(devices)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert job.stdout is not None
    line = job.stdout.readline()  # "serving on 127.0.0.1:PORT"
    return job, int(line.split(":")[-1].split(",")[0])


def exported_hang(collector: RuntimeCollector) -> float | None:
    registry = CollectorRegistry()
    registry.register(RuntimeExport(collector.snapshot))  # type: ignore[arg-type]
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("tpuboot_runtime_hang_detected{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runtime_metrics", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)
    logging.getLogger("tpuboot").setLevel(logging.CRITICAL)  # figures only here
    job, port = start_job(args.devices)
    try:
        with tempfile.TemporaryDirectory() as top:
            process = ProcReader(Root("/")).processes([job.pid])[job.pid]
            config = dataclasses.replace(
                Config(), runtime_metrics=RuntimeMetricsConfig(interval=args.interval)
            )
            tpu_env = Root(top).path(config.env.tpu_env_path)  # the job's port, as tpu-env names it
            tpu_env.parent.mkdir(parents=True)
            tpu_env.write_text(f'TPU_RUNTIME_METRICS_PORTS="{port}"\n')
            held = {job.pid: process}
            collector = RuntimeCollector(
                Root(top), config, holders=lambda: Holders(1, held), host="bench", proc=Root("/")
            )
            collector.poll_once(held, (port,))  # gRPC's first load and connection, left out
            c0, w0, t0 = cpu(), wakeups(), time.monotonic()
            for _ in range(args.polls):
                collector.poll_once(held, (port,))
            poll_cpu = (cpu() - c0) / args.polls
            poll_wakeups = (wakeups() - w0) / args.polls
            poll_wall = (time.monotonic() - t0) / args.polls
            devices = len(collector.snapshot().ports[0].reading.devices)  # type: ignore[union-attr]

            c0, w0 = cpu(), wakeups()
            scans = 20
            for _ in range(scans):
                gather(Root("/"), [])
            scan_cpu, scan_wakeups = (cpu() - c0) / scans, (wakeups() - w0) / scans
            processes = len([n for n in os.listdir("/proc") if n.isdigit()])

            polls_per_hour = 3600 / args.interval
            print(f"collector, one poll of {devices} devices on one port (mean of {args.polls}):")
            print(
                f"  CPU {poll_cpu * 1000:.2f} ms, {poll_wakeups:.1f} wake-ups, {poll_wall * 1000:.1f} ms wall"
            )
            print(
                f"  per hour at one poll per {args.interval:g} s ({polls_per_hour:.0f} polls): "
                f"CPU {poll_cpu * polls_per_hour:.2f} s, {poll_wakeups * polls_per_hour:.0f} wake-ups"
            )
            print(f"idle daemon: {TICKS_PER_HOUR} ticks an hour (the watchdog's), each waking the loop once;")
            print(
                f"  the collector's look at each tick while no chip is held (a /proc scan of {processes} "
                f"processes): CPU {scan_cpu * 1000:.2f} ms, {scan_wakeups:.1f} wake-ups; per hour "
                f"CPU {scan_cpu * TICKS_PER_HOUR:.2f} s"
            )
            print(
                f"  ratio, polling to idle, per hour: wake-ups "
                f"{(poll_wakeups * polls_per_hour + TICKS_PER_HOUR) / TICKS_PER_HOUR:.1f}x, CPU "
                f"{(poll_cpu * polls_per_hour) / max(scan_cpu * TICKS_PER_HOUR, 1e-9):.1f}x the idle look"
            )

            collector.check()  # the poller thread, at the daemon's pace
            latencies = []
            for _ in range(args.rounds):
                time.sleep(random.uniform(0, args.interval))  # a random phase of the poll cycle
                job.send_signal(signal.SIGUSR1)
                turned = time.monotonic()
                while exported_hang(collector) != 1.0:
                    time.sleep(0.01)
                latencies.append(time.monotonic() - turned)
                job.send_signal(signal.SIGUSR2)
                while exported_hang(collector) != 0.0:
                    time.sleep(0.05)
            collector.stop()
            median, worst = statistics.median(latencies), max(latencies)
            print(
                f"hang gauge on -> tpuboot_runtime_hang_detected 1 ({args.rounds} rounds): median "
                f"{median:.2f} s, worst {worst:.2f} s; ratio to the poll interval: median "
                f"{median / args.interval:.2f}, worst {worst / args.interval:.2f} (goal <= 1 + a poll)"
            )
    finally:
        job.terminate()
        job.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
