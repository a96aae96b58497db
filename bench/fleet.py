"""Fleet boot benchmark: 64 agents boot at once against one metadata server emulator that fails 20%.

Each agent is a thread running the real MetadataClient + EnvSync.sync_once against its own
temporary Root. The emulator runs in its own process (harness/mds_emulator.py) and counts
requests. Printed per scenario: agents that got tpu-env, total requests, the peak request
rate over 1 s windows and its ratio to the goal (2 requests/s per host, i.e. 128/s for 64),
and p50/p99 time-to-env (fetch, parse, durable writes); "burst" is the peak over 100 ms
windows (per second), which shows retries in lockstep that 1 s windows average away. The
baseline is the documented approach made to retry: a curl-like loop that retries every 1 s
without backoff or jitter. A second scenario adds a 5 s outage (every request fails) at boot.

    .venv/bin/python bench/fleet.py [--agents 64] [--error-rate 0.2] [--outage 5]

Traffic goes only to 127.0.0.1. Bounded: every agent gives up after 12 s, so the four
fleets take under 60 s (about 30 s when all goes well).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.table import Report, Row, safe_ratio  # noqa: E402
from harness.mds_emulator import SAMPLE_TPU_ENV, tpu_env_yaml  # noqa: E402
from tpuboot.config import Config, EnvConfig, MetadataConfig  # noqa: E402
from tpuboot.env.metadata import MetadataClient  # noqa: E402
from tpuboot.env.sync import EnvSync  # noqa: E402
from tpuboot.paths import Root  # noqa: E402

GOAL_PER_HOST = 2.0  # requests per second
AGENT_DEADLINE_S = 12.0
TPU_ENV_PATH = "instance/attributes/tpu-env"


@dataclass
class Outcome:
    name: str
    ok: int
    agents: int
    requests: int
    peak: float
    burst: float
    times: list[float]

    def percentile(self, q: float) -> float:
        if not self.times:
            return float("nan")
        ordered = sorted(self.times)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Emulator:
    """harness/mds_emulator.py in its own process, so agents and server do not share a GIL."""

    def __init__(self, work: Path, error_rate: float) -> None:
        attributes = work / "attributes.json"  # JSON is YAML
        attributes.write_text(json.dumps({"tpu-env": tpu_env_yaml(SAMPLE_TPU_ENV)}))
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "harness" / "mds_emulator.py"),
                "--attributes",
                str(attributes),
                "--error-rate",
                str(error_rate),
                "--seed",
                "1",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        self.host = line.rsplit(" ", 1)[-1].strip()
        self.control = f"http://{self.host}/_emulator/"

    def set_faults(self, **faults: object) -> None:
        request = urllib.request.Request(
            self.control + "faults", data=json.dumps(faults).encode(), method="PUT"
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            answer.read()

    def stats(self) -> dict[str, float]:
        with urllib.request.urlopen(self.control + "stats", timeout=5) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        self.process.terminate()
        self.process.communicate(timeout=10)


def tpuboot_agent(host: str, work: Path, index: int) -> Callable[[float], bool]:
    """One host running tpuboot: the real client and EnvSync on its own temporary root."""
    root_dir = work / f"host{index}"
    root_dir.mkdir()
    config = Config(metadata=MetadataConfig(host=host), env=EnvConfig())
    client = MetadataClient.from_config(config.metadata, environ={})
    sync = EnvSync(Root(root_dir), config, client)

    def boot(deadline_s: float) -> bool:
        try:
            return sync.sync_once(deadline_s).source == "metadata"
        finally:
            client.close()

    return boot


def documented_agent(host: str, work: Path, index: int) -> Callable[[float], bool]:
    """The documented script made to retry: fetch, and on failure try again 1 s later, forever."""
    url = f"http://{host}/computeMetadata/v1/{TPU_ENV_PATH}"

    def boot(deadline_s: float) -> bool:
        end = time.monotonic() + deadline_s
        session = requests.Session()
        session.trust_env = False
        while time.monotonic() < end:
            try:
                answer = session.get(url, headers={"Metadata-Flavor": "Google"}, timeout=5)
                if answer.status_code == 200:
                    (work / f"tpu-env{index}").write_bytes(answer.content)
                    return True
            except requests.RequestException:
                pass
            time.sleep(1.0)
        return False

    return boot


def run_fleet(
    name: str,
    make_agent: Callable[[str, Path, int], Callable[[float], bool]],
    agents: int,
    error_rate: float,
    outage_s: float,
) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="tpuboot-fleet-") as tmp:
        work = Path(tmp)
        emulator = Emulator(work, error_rate)
        try:
            boots = [make_agent(emulator.host, work, i) for i in range(agents)]
            times: list[float] = []
            lock = threading.Lock()
            start = threading.Barrier(agents + 1)
            if outage_s:
                emulator.set_faults(error_rate=1.0)
            deadline = AGENT_DEADLINE_S

            def run(boot: Callable[[float], bool]) -> None:
                start.wait()
                began = time.monotonic()
                if boot(deadline):
                    with lock:
                        times.append(time.monotonic() - began)

            threads = [threading.Thread(target=run, args=(boot,), daemon=True) for boot in boots]
            for thread in threads:
                thread.start()
            start.wait()
            if outage_s:
                threading.Event().wait(outage_s)
                emulator.set_faults(error_rate=error_rate)
            for thread in threads:
                thread.join(deadline + 2)
            stats = emulator.stats()
        finally:
            emulator.stop()
    requests_seen, peak, burst = (
        int(stats["requests"]),
        float(stats["peak_rate"]),
        float(stats["peak_rate_100ms"]),
    )
    return Outcome(name, len(times), agents, requests_seen, peak, burst, times)


def report(outcome: Outcome, goal: float) -> None:
    print(
        f"  {outcome.name:<22} got tpu-env {outcome.ok}/{outcome.agents}  requests {outcome.requests:4d}  "
        f"peak {outcome.peak:4.0f}/s (x{outcome.peak / goal:.2f} of goal {goal:.0f}/s)  "
        f"burst {outcome.burst:4.0f}/s  "
        f"time-to-env p50 {outcome.percentile(0.5):5.2f} s  p99 {outcome.percentile(0.99):5.2f} s"
    )


def compare(ours: Outcome, baseline: Outcome) -> None:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "n/a"

    print(
        f"  tpuboot / documented:  peak rate {ratio(ours.peak, baseline.peak)}  "
        f"burst {ratio(ours.burst, baseline.burst)}  "
        f"requests {ratio(ours.requests, baseline.requests)}  "
        f"p50 {ratio(ours.percentile(0.5), baseline.percentile(0.5))}  "
        f"p99 {ratio(ours.percentile(0.99), baseline.percentile(0.99))}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--error-rate", type=float, default=0.2)
    parser.add_argument(
        "--outage", type=float, default=5.0, help="seconds of total failure at boot (0: skip)"
    )
    args = parser.parse_args()
    logging.getLogger("tpuboot").setLevel(logging.CRITICAL)  # 64 simulated hosts would each log their retries
    goal = GOAL_PER_HOST * args.agents
    began = time.monotonic()
    scenarios = [("boot, 20% of requests fail", 0.0)]
    if args.outage:
        scenarios.append((f"boot during a {args.outage:g} s outage, then 20% fail", args.outage))
    failed = False
    for title, outage in scenarios:
        print(f"{args.agents} agents, {title.replace('20%', f'{args.error_rate:.0%}')}:")
        ours = run_fleet("tpuboot", tpuboot_agent, args.agents, args.error_rate, outage)
        baseline = run_fleet("documented (1 s retry)", documented_agent, args.agents, args.error_rate, outage)
        report(ours, goal)
        report(baseline, goal)
        compare(ours, baseline)
        failed |= ours.ok != args.agents
    print(f"total {time.monotonic() - began:.1f} s")
    return 1 if failed else 0


FLEET_AGENTS, FLEET_ERROR_RATE, FLEET_OUTAGE_S = 64, 0.2, 5.0


def run_family(report: Report) -> None:
    """bench/fleet.py's two scenarios, tpuboot and the documented retry loop each, as table rows."""
    logging.getLogger("tpuboot").setLevel(logging.CRITICAL)  # 64 hosts would each log their retries
    goal = GOAL_PER_HOST * FLEET_AGENTS
    for label, outage in (("", 0.0), (f", after a {FLEET_OUTAGE_S:g} s outage", FLEET_OUTAGE_S)):
        ours = run_fleet("tpuboot", tpuboot_agent, FLEET_AGENTS, FLEET_ERROR_RATE, outage)
        base = run_fleet("documented", documented_agent, FLEET_AGENTS, FLEET_ERROR_RATE, outage)
        title = f"fleet of {FLEET_AGENTS}, {FLEET_ERROR_RATE:.0%} of requests fail{label}"
        verdict = "PASS" if ours.peak <= goal and ours.ok == FLEET_AGENTS else "FAIL"
        report.add(
            "fleet",
            Row(
                f"{title}: peak requests/s (1 s windows)",
                f"{ours.peak:.0f}/s",
                f"{base.peak:.0f}/s",
                safe_ratio(ours.peak, base.peak),
                f"<= {goal:.0f}/s",
                verdict,
            ),
        )
        report.add(
            "fleet", Row("  hosts that got tpu-env", f"{ours.ok}/{ours.agents}", f"{base.ok}/{base.agents}")
        )
        report.add(
            "fleet",
            Row(
                "  requests in all",
                str(ours.requests),
                str(base.requests),
                safe_ratio(ours.requests, base.requests),
            ),
        )
        for q in (0.5, 0.99):
            mine, theirs = ours.percentile(q), base.percentile(q)
            report.add(
                "fleet",
                Row(
                    f"  time to tpu-env, p{q * 100:g}",
                    f"{mine:.2f} s",
                    f"{theirs:.2f} s",
                    safe_ratio(mine, theirs),
                ),
            )
        report.raw.setdefault("fleet", []).append(
            {"outage_s": outage, "tpuboot": asdict(ours), "documented": asdict(base)}
        )
    report.note(
        "fleet",
        "baseline: the documented fetch retried every 1 s (no backoff, no jitter); "
        "tpuboot: MetadataClient + EnvSync, one thread per simulated host, emulator in its own process",
    )


if __name__ == "__main__":
    sys.exit(main())
