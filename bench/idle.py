"""Family idle: the daemon's VmRSS, CPU ticks (utime+stime), its wake-ups and per-thread context
switches (voluntary; schedstat timeslices) over the 60 s that a ``python3 -c 'import time;
time.sleep(60)'`` process sleeps; that process's VmRSS is the RSS baseline.

A wake-up of the process is a run of its threads' wake-ups (the kernel's ``sched_wakeup``
events) with gaps under :data:`EPISODE_GAP_S`, named by the first, which woke the sleeping process
(a timer or a packet: an interrupt; another process). A thread's voluntary switches count more
than that: one wake-up of the process costs several when its threads hand work to each other (the
loop hands the tick's round to the pool, the GIL passes), so they are shown, not judged.

Threads are named by the system call they block in (Python 3.11 gives its threads no kernel
name). This window runs first, while the next family's guest boots: wakeups and RSS do not depend
on host load. Then tpuboot is stopped and google-guest-agent started alone, against the metadata
emulator on 169.254.169.254:80 (an address on lo); after 30 s of its start-up work, the same
window on its process. Each emulator counts the requests of the window (``GET /_emulator/stats``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import peers
from bench.guest import BenchError, booted, helper, stop_tpuboot, unit_properties
from bench.table import Report, Row
from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import (
    GUEST_LIBEXEC,
    Artifacts,
    InstallHook,
)
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    MDS_PORT,
    guest_config,
    vbar_install_hook,
)

log = logging.getLogger("bench.bind")

RSS_GOAL_MIB = 20.0
LONG_POLL_S = 60.0  # metadata.watch_timeout: the watch's long-poll returns this often when idle
#: Wake-ups of the process's threads closer than this are one wake-up of the process (a handoff
#: between its threads, an answer to a request it just sent), as powertop counts them per event.
EPISODE_GAP_S = 0.1


def thread_role(thread: dict[str, Any]) -> tuple[str, str]:
    """A short role and a description of a tpuboot thread, from the call it sleeps in and on what.

    Python 3.11 gives its threads no kernel name, so this is how the threads are told apart.
    """
    call = thread["syscall"]
    if "timeout_ms" in thread:
        call += " (no timeout)" if thread["timeout_ms"] < 0 else f" (timeout {thread['timeout_ms']} ms)"
    waits_on = thread.get("waits_on", "")
    where = f"{call} on {waits_on}" if waits_on else call
    if thread["main"]:
        return "main", f"main thread, the event loop: {where}"
    if "listening on" in waits_on:
        return "server", f"server thread: {where}"
    if waits_on.endswith(f":{MDS_PORT}"):
        return "metadata-watch", f"metadata watch: {where}"
    if waits_on == "unix socket":  # the daemon's one blocking stream socket is dockerd's
        return "docker-events", f"vBar supervisor, following dockerd's events: {where}"
    if thread["syscall"] == "futex":
        return "idle", "waits on a lock or queue (futex): pool worker or a thread being joined"
    return "other", where


def wake_episodes(wakeups: list[dict[str, Any]], tids: set[int]) -> list[dict[str, Any]]:
    """The process's wake-ups: each run of its threads' wake-ups (``tid``, time ``t``, the task
    ``by`` running then, in an interrupt or not: ``irq``) with gaps under :data:`EPISODE_GAP_S`,
    as its first one, with ``cause``: interrupt (a timer, a packet), own thread, or another process."""
    episodes: list[dict[str, Any]] = []
    last = None
    for wakeup in sorted(wakeups, key=lambda w: w["t"]):
        if last is None or wakeup["t"] - last >= EPISODE_GAP_S:
            cause = "interrupt" if wakeup["irq"] else "own thread" if wakeup["by"] in tids else "process"
            episodes.append({**wakeup, "cause": cause})
        last = wakeup["t"]
    return episodes


def systemd_seconds(span: str) -> float:
    """A systemd time span as ``systemctl show`` prints it (``1min 30s``, ``500ms``) in seconds."""
    units = {"h": 3600.0, "min": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)\s*(h|min|ms|us|s)", span))


class IdleFamily:
    """Family 4 in the background: the guest boots in front, its 60 s window runs in a thread.

    Its guest is configured as a TPU VM off GKE is: tpuboot supervises vBar (a stand-in image)
    under a real dockerd, and the window starts once the STATUS line says vBar is running.
    """

    def __init__(self, artifacts: Artifacts, image: Path, window: float) -> None:
        self.artifacts, self.image, self.window = artifacts, image, window
        self._guest = ExitStack()
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None

    def start(self) -> None:
        with ExitStack() as on_error:
            on_error.callback(self.close)
            vm = self._guest.enter_context(
                booted(self.artifacts, self.image, "idle", devices=["edu", "virtio-rng-pci"], memory=1536)
            )
            vm.wait_until(
                "systemctl show -P StatusText tpuboot | grep -q 'vBar: running'", timeout=240, interval=1.0
            )
            props = unit_properties(vm, "MainPID", "WatchdogUSec", "StatusText")
            on_error.pop_all()
        self._result["unit"] = props

        def measure() -> None:
            try:
                self._result["data"] = helper(
                    vm, "idle", props["MainPID"], "--window", str(self.window),
                    "--stats", f"http://127.0.0.1:{MDS_PORT}/_emulator/stats", timeout=self.window + 90,
                )  # fmt: skip
                self._result["peer"] = idle_peer(vm, self.window)
            except BaseException as exc:  # reported by finish(), in the main thread
                self._error = exc

        self._thread = threading.Thread(target=measure, name="idle-window", daemon=True)
        self._thread.start()
        log.info("idle: %.0f s window started", self.window)

    def finish(self, report: Report) -> None:
        """Wait for the window (bounded), stop the guest, add the rows; once."""
        if self._thread is None:
            return
        thread, self._thread = self._thread, None
        thread.join(timeout=2 * self.window + PEER_SETTLE_S + 300)
        self.close()
        if thread.is_alive():
            raise BenchError("idle: the measurement did not end")
        if self._error is not None:
            raise self._error
        idle_report(self._result["data"], self._result["unit"], report, self._result.get("peer"))

    def close(self) -> None:
        """Kill the idle guest (safe to call twice)."""
        self._guest.close()


PEER_SETTLE_S = 30.0  # google-guest-agent's start-up work (users, keys, OS Login) is over by then
GCE_MDS_UNIT = "tpuboot-bench-gce-mds"


def idle_peer(vm: VM, window: float) -> dict[str, Any]:
    """google-guest-agent alone (tpuboot stopped) against the GCE emulator on 169.254.169.254:80,
    over the same window, once its start-up work is over."""
    stop_tpuboot(vm)
    helper(vm, "route-metadata", "--address", peers.GCE_MDS_ADDRESS)
    vm.run(
        ["systemd-run", f"--unit={GCE_MDS_UNIT}", "python3", f"{GUEST_LIBEXEC}/mds_emulator.py",
         "--bind", peers.GCE_MDS_ADDRESS, "--port", "80", "--log-requests",
         "--attributes", "/etc/tpuboot-test/attributes.yaml", "--instance", peers.GCE_INSTANCE_FILE],
        check=True,
    )  # fmt: skip
    url = f"http://{peers.GCE_MDS_ADDRESS}/computeMetadata/v1/instance/id"
    vm.wait_until(f"curl -sf -H 'Metadata-Flavor: Google' {url}", timeout=60, interval=1.0)
    vm.run(["systemctl", "start", "google-guest-agent"], timeout=180, check=True)
    time.sleep(PEER_SETTLE_S)
    props = unit_properties(vm, "MainPID", "ActiveState", unit="google-guest-agent")
    if props.get("ActiveState") != "active" or props.get("MainPID", "0") == "0":
        raise BenchError(f"google-guest-agent is not running: {props}\n{vm.journal('google-guest-agent')}")
    data = helper(
        vm, "idle", props["MainPID"], "--window", str(window),
        "--stats", f"http://{peers.GCE_MDS_ADDRESS}/_emulator/stats", timeout=window + 90,
    )  # fmt: skip
    data["journal"] = vm.journal("google-guest-agent")[-3000:]
    data["requests_log"] = vm.journal(GCE_MDS_UNIT)[-6000:]
    return data


def idle_report(
    data: dict[str, Any], unit: dict[str, str], report: Report, peer: dict[str, Any] | None = None
) -> None:
    window = data["window_s"]
    ping_s = systemd_seconds(unit["WatchdogUSec"]) / 2
    pings = int(window // ping_s) if ping_s else 0
    polls = int(window // LONG_POLL_S)
    rss, sleeper = data["rss_kib"] / 1024, data["sleeper_rss_kib"] / 1024
    verdict = "PASS" if rss <= RSS_GOAL_MIB else "FAIL"
    rss_row = Row("idle RSS: daemon | sleeping python3", f"{rss:.1f} MiB", f"{sleeper:.1f} MiB",
                  rss / sleeper, f"<= {RSS_GOAL_MIB:g} MiB", verdict)  # fmt: skip
    ticks = sum(t["ticks"] for t in data["threads"])
    ticks_row = Row(f"idle CPU over {window:.0f} s (utime+stime)", f"{ticks} ticks", "", None)
    split = Row("  RSS anon + file", split_mib(data), "", None)
    voluntary = sum(t["voluntary"] for t in data["threads"])
    switches = Row(
        f"  voluntary context switches (all threads) over {window:.0f} s", str(voluntary), "", None
    )
    roles = {t["tid"]: thread_role(t)[0] for t in data["threads"]}
    episodes = wake_episodes(data["wakeups"], set(roles))
    wakes = Row(f"  the process's wake-ups over {window:.0f} s", str(len(episodes)), "", None)
    per_minute = Row("idle metadata requests per minute", requests_per_minute(data), "", None)
    if peer is not None:
        gga = "google-guest-agent"
        peer_rss = peer["rss_kib"] / 1024
        rss_row.at_most(gga, f"{peer_rss:.1f} MiB", rss, peer_rss)
        split.at_most(gga, split_mib(peer), data["rss_anon_kib"], peer["rss_anon_kib"])
        peer_ticks = sum(t["ticks"] for t in peer["threads"])
        ticks_row.at_most(gga, f"{peer_ticks} ticks", ticks, peer_ticks)
        peer_voluntary = sum(t["voluntary"] for t in peer["threads"])
        switches.at_most(gga, str(peer_voluntary), voluntary, peer_voluntary)
        peer_episodes = len(wake_episodes(peer["wakeups"], {t["tid"] for t in peer["threads"]}))
        wakes.at_most(gga, str(peer_episodes), len(episodes), peer_episodes)
        per_minute.peer = f"{gga}: {requests_per_minute(peer)}"
        report.note(
            "idle",
            f"google-guest-agent {len(peer['threads'])} threads: "
            + "; ".join(
                f"tid {t['tid']} {t['syscall']}: {t['voluntary']} voluntary, {t['ticks']} ticks"
                for t in peer["threads"]
                if t["voluntary"] or t["ticks"]
            ),
        )
        report.raw["idle_peer"] = peer
    report.add("idle", rss_row)
    report.add("idle", split)
    report.add("idle", ticks_row)
    per_role: dict[str, int] = {}
    for t in data["threads"]:
        short, role = thread_role(t)
        per_role[short] = per_role.get(short, 0) + t["voluntary"]
        report.note(
            "idle",
            f"tid {t['tid']} {role}: {t['voluntary']} voluntary + {t['involuntary']} involuntary "
            f"switches, {t['timeslices']} timeslices, {t['ticks']} ticks",
        )
    # The watchdog's tick wakes the loop, which hands the parts' tick work to the pool in the same
    # wake-up; each long-poll's answer wakes its watch; nothing else should.
    long_polls = sum(1 for role in roles.values() if role == "metadata-watch")
    expected = pings + 1 + long_polls * (polls + 1)
    started: dict[str, int] = {}
    for episode in episodes:
        key = f"{roles.get(episode['tid'], 'a thread gone')} ({episode['cause']})"
        started[key] = started.get(key, 0) + 1
    report.add(
        "idle",
        Row(f"idle wake-ups over {window:.0f} s, by the thread woken first",
            ", ".join(f"{key} {n}" for key, n in started.items()) or "none",
            f"expected: {pings} ticks + {long_polls} long-polls x {polls + 1}", None,
            "the tick + long-poll answers only",
            "PASS" if len(episodes) <= expected else f"FAIL (+{len(episodes) - expected})"),
    )  # fmt: skip
    report.add("idle", wakes)
    report.add("idle", Row(f"  context switches over {window:.0f} s, per thread",
                           ", ".join(f"{role} {n}" for role, n in per_role.items()), "", None))  # fmt: skip
    report.add("idle", switches)
    report.add("idle", per_minute)
    report.note(
        "idle",
        f"WatchdogSec={unit['WatchdogUSec']}: a ping every {ping_s:g} s; RSS "
        f"{data['rss_anon_kib'] / 1024:.1f} MiB anon + {data['rss_file_kib'] / 1024:.1f} MiB file; "
        f"status: {unit['StatusText']}",
    )
    where = data.get("anon_kib_by_mapping", {})
    if where:
        report.note(
            "idle",
            "the daemon's anonymous memory by mapping: "
            + "; ".join(f"{kind} {kib / 1024:.1f} MiB" for kind, kib in where.items()),
        )
    report.raw["idle"] = {"unit": unit, **data}


def split_mib(data: dict[str, Any]) -> str:
    return f"{data['rss_anon_kib'] / 1024:.1f} + {data['rss_file_kib'] / 1024:.1f} MiB"


def requests_per_minute(data: dict[str, Any]) -> str:
    count = data.get("metadata_requests")
    return "n/a" if count is None else f"{count * 60 / data['window_s']:.1f}/min"


IDLE_VBAR_IMAGE = "tpuboot-bench/vbar:1"


def idle_install_hook(deb: Path) -> InstallHook:
    """The idle guest: vBar supervised from a stand-in image, named by tpu-env as on a TPU VM."""
    # A local name, which dockerd reads as Docker Hub's.
    config = guest_config(
        vbar={"enabled": True, "image": IDLE_VBAR_IMAGE, "registries": ["docker.io/tpuboot-bench"]}
    )
    tpu_env = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": IDLE_VBAR_IMAGE}
    return vbar_install_hook(deb, config, tpu_env, [IDLE_VBAR_IMAGE])
