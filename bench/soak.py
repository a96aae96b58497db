"""``python -m bench.soak --minutes N``: a soak and fault campaign against tpuboot in a QEMU guest.

The guest is a TPU VM off GKE (tpuboot from its .deb, two cold-plugged stand-in TPUs, four empty
hotplug ports, a real dockerd running the vBar stand-in, the metadata emulator). For N minutes
the host drives, at random:

* QMP hotplug add and remove of stand-in TPUs (also while tpuboot is stopped);
* the metadata emulator going down, slow, 5xx, trickling, cut short, flavourless, flapping;
* tpu-env documents: good ones, hostile values, YAML 1.1 look-alikes, keys to skip, and
  documents that must be refused whole (syntax errors, aliases, not a mapping, too deep, too big);
* dockerd restarts and kills of the vBar container;
* graceful restarts and SIGKILLs of tpuboot itself.

Meanwhile a reader in the guest (``bench/soak_reader.py``) reads the tpu-env file every 20 ms.
The report: daemon crashes (exits systemd saw that the soak did not cause), devices left unbound
after their events settled, reads that found the file missing, garbled or holding values no
document gave (each run of those named after the document nearest to it and the documents served
just before it), a file still wrong long after the faults cleared, file descriptors, threads and
RSS growth per hour, and error lines by kind. Exit status 1 on any crash, lost device, missing
or wrong file, or a vBar not running at the end.

``--life-minutes M`` (at least 30) is the long-life mode: the same campaign, but tpuboot is never
restarted, stopped or killed by it except once every M minutes, so each process lives M minutes
under the faults; the report gives each life's RSS, fds and threads per hour (the least-squares
slope after its first :data:`WARMUP_S` seconds, which are start-up, not growth), RSS by kind of
mapping (``/proc/PID/smaps``) and in each half of the life. ``--minutes`` then defaults to one
life.

Not a test: ``tests/vm/test_soak.py`` runs a short one in the test run.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import logging
import math
import random
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.soak_reader import parse as parse_env_text
from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV
from harness.vm.artifacts import (
    BOOKWORM,
    GUEST_LIBEXEC,
    InstallHook,
    build_image,
    ensure_artifacts,
    remove_tree,
)
from harness.vm.hostenv import cache_dir
from harness.vm.machine import VM, VMError
from harness.vm.tpuboot_guest import EDU, MDS_PORT, build_deb, guest_config, vbar_install_hook
from tpuboot.env.tpuenv import TpuEnvError, parse_tpu_env

log = logging.getLogger("bench.soak")

HERE = Path(__file__).resolve().parent
TPU_ENV_FILE = "/home/tpu-runtime/tpu-env"
VBAR = "tpuboot-vbar-control-agent"
VBAR_IMAGE = "tpuboot-test/vbar:1"
MDS_UNIT = "tpuboot-test-mds.service"
READER = f"{GUEST_LIBEXEC}/soak_reader.py"
READER_CATALOG = "/run/tpuboot-soak/catalog.json"
READER_OUT = "/run/tpuboot-soak/reader.json"
READER_UNIT = "tpuboot-soak-reader"
TEMP_DIRS = "/home/tpu-runtime /etc /var/lib/tpuboot"  # where tpuboot's atomic writes put temp files
SYSTEMD_EXITS = ("Main process exited", "Watchdog timeout", "start-limit")
HOTPLUG_PORTS = 4
COLD_STAND_INS = 2

# Limits the soak holds tpuboot to. systemd's own start limit (5 starts in 300 s) bounds how often
# the soak may restart tpuboot; docker.service's (3 in 60 s) how often dockerd.
BIND_SETTLE_S = 60.0  # an added stand-in is bound and usable within this
FILE_SETTLE_S = 200.0  # tpu-env is right within this once faults cleared (the watch backs off up to 32 s
#                        after a 30 s fault, a trickled long-poll ends within its 65 s deadline)
VBAR_SETTLE_S = 240.0  # vBar runs again within this at the end (crash-loop backoff, dockerd start)
LIFECYCLE_GAP_S = 75.0
DOCKERD_GAP_S = 60.0
SAMPLE_EVERY_S = 15.0
LONG_LIFE_MIN = 30.0  # minutes: a shorter life's slope is start-up warm-up, not growth
WARMUP_S = 300.0  # the first seconds of a life left out of its slope
FAULT_HOLD_S = (5.0, 30.0)

BASE = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": VBAR_IMAGE}
CONFIG = guest_config(
    vbar={"enabled": True, "image": "tpuboot-test/vbar:config", "registries": ["docker.io/tpuboot-test"]},
    supervisor={"backoff_initial": 1, "backoff_max": 8, "stable_after": 60, "pull_retries": 6},
    # A restart while the emulator is down falls back to the cache after this, not after 60 s.
    metadata={"boot_deadline": 15},
)


@dataclass(frozen=True)
class Doc:
    """A tpu-env document the emulator serves, and the values the file must then hold (None: the
    document is refused whole and the file keeps the last good values)."""

    label: str
    text: str
    expected: dict[str, str] | None
    pad: int = 0  # a YAML comment of this many bytes appended in the guest (too big to send)


def _dump(values: dict[str, str], extra: str = "") -> str:
    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True) + extra


LOOKALIKES = "OCTAL: 0123\nSEXAGESIMAL: 1:30\nHEX: 0x10\nBOOLEAN: yes\nTILDE: ~\nFLOAT: 1.50\n"
UNBUILDABLE = "DATE: 2026-02-30\nEMPTY_INT: !!int ''\nHUGE: " + "9" * 5000 + "\n"
SKIPPED = "PATH: /evil\nbad-name: x\nLD_PRELOAD: /tmp/x.so\nBLOB: !!binary aGk=\nNESTED: {a: b}\n"

CATALOG: tuple[Doc, ...] = (
    Doc("sample", _dump(BASE), BASE),
    Doc("worker 3", _dump({**BASE, "WORKER_ID": "3"}), {**BASE, "WORKER_ID": "3"}),
    Doc("hostile values", _dump({**BASE, **HOSTILE_VALUES}), {**BASE, **HOSTILE_VALUES}),
    Doc(
        "YAML 1.1 look-alikes",
        _dump(BASE, LOOKALIKES),
        {**BASE, "OCTAL": "0123", "SEXAGESIMAL": "1:30", "HEX": "0x10", "BOOLEAN": "yes", "TILDE": "~"}
        | {"FLOAT": "1.50"},
    ),
    Doc(
        "scalars YAML cannot construct",
        _dump(BASE, UNBUILDABLE),
        {**BASE, "DATE": "2026-02-30", "EMPTY_INT": "", "HUGE": "9" * 5000},
    ),
    Doc("names and tags to skip", _dump(BASE, SKIPPED), BASE),
    Doc("syntax error", "ZONE: [unclosed\nWORKER_ID: '9'\n", None),
    Doc("not a mapping", "- ZONE\n- WORKER_ID\n", None),
    Doc("alias", "ZONE: &z us-east5-a\nWORKER_ID: *z\n", None),
    Doc("nested too deep", "ZONE: " + "[" * 100 + "]" * 100 + "\n", None),
    Doc("python tag", "!!python/object/apply:os.system ['touch /tmp/pwned']\n", None),
    Doc("larger than 1 MiB", _dump({**BASE, "WORKER_ID": "7"}), None, pad=(1 << 20) + 1),
)

FAULTS: dict[str, dict[str, Any] | None] = {
    "down": None,  # the emulator's unit stopped: connection refused
    "slow": {"delay": 8.0},
    "503": {"status": 503},
    "500 half the time": {"error_rate": 0.5, "error_status": 500},
    "trickled headers": {"trickle_headers": 0.5},
    "trickled body": {"trickle_body": 0.5},
    "cut short": {"drop": True},
    "no flavor header": {"flavor": None},
    "flapping etag": {"flapping_etag": True},
    # More declared than sent, whatever the document's size. (A fixed Content-Length below a document's
    # size is a whole answer of its own, a prefix: "100000" made one of the 1 MiB document's, which
    # parsed, and the file held values no document gave: issue 38.)
    "short body": {"short_by": 1000},
}

# PUT to the emulator's control endpoint from inside the guest: body on stdin, optional padding;
# prints the guest's CLOCK_MONOTONIC before the request and after its answer.
PUT = (
    "import sys, time, urllib.request; body = sys.stdin.buffer.read() + b'#' * int(sys.argv[2]); "
    "sent = time.monotonic(); "
    "urllib.request.urlopen(urllib.request.Request(sys.argv[1], body, method='PUT'), timeout=30); "
    "print(sent, time.monotonic())"
)
CONNECT = f"import socket; socket.create_connection(('127.0.0.1', {MDS_PORT}), 1)"
# RSS by kind of mapping, as /proc/PID/smaps lists them (KiB): brk's [heap], anonymous ones (pymalloc's
# arenas, malloc's per-thread arenas and large blocks, thread stacks), file-backed ones (code, the
# interpreter's and libraries' data), and the rest ([stack], [vdso], ...).
MAPPINGS = ("heap", "anon", "file", "other")
SMAPS_BY_KIND = (
    'awk \'/^[0-9a-f]+-[0-9a-f]+ /{k = $6 == "[heap]" ? "heap" : $6 == "" ? "anon" : '
    '$6 ~ /^\\// ? "file" : "other"; next} /^Rss:/{r[k] += $2} '
    'END{printf "%d %d %d %d", r["heap"], r["anon"], r["file"], r["other"]}\' /proc/$pid/smaps'
)
PROBE = (
    "pid=$(systemctl show -P MainPID tpuboot); "
    'if [ "$pid" -gt 0 ] 2>/dev/null && [ -d /proc/$pid ]; then '
    "echo $pid $(ls /proc/$pid/fd | wc -l) $(awk '/^VmRSS|^Threads/{print $2}' /proc/$pid/status) "
    f"$({SMAPS_BY_KIND}); "
    "else echo 0; fi"
)


def reader_catalog() -> list[dict[str, Any]]:
    """What the reader compares each read with (``bench/soak_reader.py``): the values the file may
    hold, and, to name a wrong read after, those of each refused document whose text without its
    padding would parse (the 1 MiB document's prefix)."""
    catalog: list[dict[str, Any]] = [{"label": "sample (served at boot)", "values": BASE, "good": True}]
    for doc in CATALOG:
        if doc.expected is not None:
            catalog.append({"label": doc.label, "values": doc.expected, "good": True})
            continue
        try:
            values = dict(parse_tpu_env(doc.text.encode()).values)
        except TpuEnvError:
            continue
        catalog.append({"label": f"{doc.label} (refused whole)", "values": values, "good": False})
    return catalog


def soak_install_hook(deb: Path) -> InstallHook:
    """The guest: tpuboot's .deb, vBar on under the real dockerd, the emulator serving the catalog's
    first document, and the reader."""
    base = vbar_install_hook(deb, CONFIG, BASE, (VBAR_IMAGE,))

    def install(tree: Path) -> None:
        base(tree)
        target = tree / READER.lstrip("/")
        target.write_bytes((HERE / "soak_reader.py").read_bytes())
        target.chmod(0o755)

    return install


# --------------------------------------------------------------------------- the report


@dataclass
class Growth:
    """Within-process linear growth per hour (pooled over tpuboot's process lifetimes)."""

    fds: float = 0.0
    threads: float = 0.0
    rss_kib: float = 0.0
    samples: int = 0
    hours: float = 0.0


@dataclass
class Life:
    """One tpuboot process as sampled: how long, and (fds, threads, RSS KiB) first and last."""

    minutes: float = 0.0
    first: tuple[int, int, int] = (0, 0, 0)
    last: tuple[int, int, int] = (0, 0, 0)


def longest_life(samples: Sequence[tuple[int, float, int, int, int]]) -> Life:
    """The process (pid) sampled over the longest stretch: growth shows plainest there."""
    by_pid: dict[int, list[tuple[int, float, int, int, int]]] = collections.defaultdict(list)
    for sample in samples:
        by_pid[sample[0]].append(sample)
    if not by_pid:
        return Life()
    life = max(by_pid.values(), key=lambda points: points[-1][1] - points[0][1])
    return Life((life[-1][1] - life[0][1]) / 60, life[0][2:], life[-1][2:])


@dataclass
class LifeGrowth:
    """One tpuboot process of a long-life soak: its length and its growth per hour after warm-up."""

    pid: int
    minutes: float
    samples: int  # after warm-up, in the slope
    fds: float
    threads: float
    rss_kib: float
    first: tuple[int, int, int]  # (fds, threads, RSS KiB) at its first and last sample
    last: tuple[int, int, int]
    # RSS per hour over the first and the second half of the samples after warm-up (the smaps sum
    # when sampled): growth that levels off (an allocator settling) slows in the second; a leak
    # keeps its pace.
    rss_halves: tuple[float, float] = (0.0, 0.0)
    # Each half's slope's standard error (:func:`slope_error_per_hour`): a half is flat when its
    # slope is within two of them of zero.
    rss_half_errors: tuple[float, float] = (0.0, 0.0)
    # RSS per hour after warm-up as smaps sums it: exact, where VmRSS (rss_kib) is, up to kernel
    # 6.1, a sum of per-thread counters each flushed only every 64 page faults of its thread.
    smaps_kib: float = 0.0
    # Each kind of mapping (:data:`MAPPINGS`) after warm-up: (first KiB, last KiB, KiB per hour).
    mappings: dict[str, tuple[int, int, float]] = field(default_factory=dict)


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope per hour of (seconds, value) points (0 for fewer than 3)."""
    return pooled_slope([(0, t, v) for t, v in points])[0]


def slope_error_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """The standard error per hour of :func:`slope_per_hour` (0 for fewer than 4 points).

    Memory moves in steps (an arena grows, a pool worker starts), so the residuals of one sample
    and the next are alike: the samples say less than their number. The error is widened as for
    residuals that follow their predecessor with the lag-1 autocorrelation r measured in them
    (the effective number of samples is n (1 - r) / (1 + r)); r is taken as 0 at least and 0.99
    at most."""
    n = len(points)
    if n < 4:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    stt = sum((t - mt) ** 2 for t, _ in points)
    if not stt:
        return 0.0
    slope = sum((t - mt) * (v - mv) for t, v in points) / stt
    residuals = [v - mv - slope * (t - mt) for t, v in points]
    sse = sum(e * e for e in residuals)
    if not sse:
        return 0.0
    r = sum(a * b for a, b in itertools.pairwise(residuals)) / sse
    r = min(max(r, 0.0), 0.99)
    return math.sqrt(sse / (n - 2) / stt * (1 + r) / (1 - r)) * 3600


def life_growth(
    samples: Sequence[tuple[int, float, int, int, int]],
    warmup_s: float = WARMUP_S,
    maps: Sequence[tuple[int, float, int, int, int, int]] = (),
) -> list[LifeGrowth]:
    """Each process's slopes per hour (fds, threads, RSS, RSS in each half, RSS of each kind of
    mapping from ``maps``: pid, seconds, KiB per :data:`MAPPINGS`) over its samples after
    ``warmup_s`` seconds of its sampled life, longest life first; a process with fewer than 3 such
    samples is left out."""
    by_pid: dict[int, list[tuple[int, float, int, int, int]]] = collections.defaultdict(list)
    for sample in samples:
        by_pid[sample[0]].append(sample)
    lives = []
    for pid, points in by_pid.items():
        start = points[0][1]
        settled = [p for p in points if p[1] - start >= warmup_s]
        if len(settled) < 3:
            continue
        slopes = [slope_per_hour([(p[1], p[2 + i]) for p in settled]) for i in range(3)]
        mine = [m for m in maps if m[0] == pid and m[1] - start >= warmup_s]
        total = (
            [(m[1], float(sum(m[2:]))) for m in mine] if len(mine) >= 3 else [(p[1], p[4]) for p in settled]
        )
        middle = (total[0][0] + total[-1][0]) / 2
        parts = ([(t, v) for t, v in total if t <= middle], [(t, v) for t, v in total if t >= middle])
        halves = (slope_per_hour(parts[0]), slope_per_hour(parts[1]))
        errors = (slope_error_per_hour(parts[0]), slope_error_per_hour(parts[1]))
        by_kind = {
            kind: (mine[0][2 + i], mine[-1][2 + i], slope_per_hour([(m[1], m[2 + i]) for m in mine]))
            for i, kind in enumerate(MAPPINGS)
            if len(mine) >= 3
        }
        minutes = (points[-1][1] - start) / 60
        smaps = slope_per_hour(total) if len(mine) >= 3 else 0.0
        ends = (points[0][2:], points[-1][2:])
        growth = LifeGrowth(
            pid, minutes, len(settled), *slopes, *ends, halves, errors, smaps_kib=smaps, mappings=by_kind
        )
        lives.append(growth)
    return sorted(lives, key=lambda life: -life.minutes)


@dataclass
class SoakReport:
    minutes: float
    seed: int
    actions: dict[str, int] = field(default_factory=dict)
    documents: dict[str, int] = field(default_factory=dict)
    hotplug_cycles: int = 0
    crashes: list[str] = field(default_factory=list)
    lost_devices: list[str] = field(default_factory=list)
    reader: dict[str, Any] = field(default_factory=dict)
    wrong_file: list[str] = field(default_factory=list)
    unexpected_reads: list[str] = field(default_factory=list)  # each streak, explained
    served: list[tuple[float, str]] = field(default_factory=list)  # (soak time, label) of each document
    file_settle_s: list[float] = field(default_factory=list)
    vbar_running_at_end: bool = False
    vbar_longest_down_s: float = 0.0
    growth: Growth = field(default_factory=Growth)
    longest: Life = field(default_factory=Life)
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    leftover_temps: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    life_minutes: float | None = None  # the long-life mode's life (None: restarts at random)
    lives: list[LifeGrowth] = field(default_factory=list)
    # Every probe: (pid, soak time, fds, threads, VmRSS KiB), and (pid, soak time, KiB per MAPPINGS).
    samples: list[tuple[int, float, int, int, int]] = field(default_factory=list)
    maps: list[tuple[int, float, int, int, int, int]] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = [f"tpuboot crashed: {c}" for c in self.crashes]
        out += [f"device left unbound: {d}" for d in self.lost_devices]
        for kind in ("missing", "garbled"):
            if self.reader.get(kind):
                out.append(f"tpu-env read {kind} {self.reader[kind]} times: {self.reader.get('samples')}")
        if self.reader.get("unexpected"):
            streaks = "".join(f"\n      {streak}" for streak in self.unexpected_reads)
            out.append(f"tpu-env held values no document gave in {self.reader['unexpected']} reads:{streaks}")
        if not self.reader.get("reads"):
            out.append("the tpu-env reader made no reads")
        out += [f"tpu-env wrong after faults cleared: {w}" for w in self.wrong_file]
        if not self.vbar_running_at_end:
            out.append(f"vBar not running {VBAR_SETTLE_S:.0f} s after the last fault")
        out += [f"temporary file left behind: {t}" for t in self.leftover_temps]
        return out

    def render_lives(self) -> list[str]:
        if self.life_minutes is None:
            return []
        lines = [
            f"long lives (restarted only every {self.life_minutes:g} min; slopes per hour of life "
            f"after its first {WARMUP_S / 60:g} min, sampled every {SAMPLE_EVERY_S:g} s):"
        ]
        for life in self.lives:
            lines.append(
                f"  pid {life.pid}, {life.minutes:.1f} min ({life.samples} samples): "
                f"RSS {life.rss_kib:+.0f} KiB/h, fds {life.fds:+.2f}/h, threads {life.threads:+.2f}/h; "
                f"first -> last: RSS {life.first[2]} -> {life.last[2]} KiB, "
                f"fds {life.first[0]} -> {life.last[0]}, threads {life.first[1]} -> {life.last[1]}"
            )
            halves = [
                f"{v:+.0f} ± {2 * e:.0f}" for v, e in zip(life.rss_halves, life.rss_half_errors, strict=True)
            ]
            second, error = life.rss_halves[1], life.rss_half_errors[1]
            verdict = "flat" if abs(second) <= 2 * error else "growing" if second > 0 else "shrinking"
            lines.append(
                f"    RSS per hour in the first and second half after warm-up: {', '.join(halves)} KiB/h "
                f"(± two standard errors): the second half {verdict}"
            )
            if life.mappings:
                lines.append(
                    f"    RSS by mapping after warm-up (smaps, {life.smaps_kib:+.0f} KiB/h in all; "
                    "first -> last, per hour): "
                    + "; ".join(f"{k} {a} -> {b} KiB {s:+.0f}/h" for k, (a, b, s) in life.mappings.items())
                )
        if not self.lives:
            lines.append("  none sampled long enough")
        return lines

    def render(self) -> str:
        settle = sorted(self.file_settle_s)
        median = settle[len(settle) // 2] if settle else 0.0
        lines = [
            f"soak: {self.elapsed_s / 60:.1f} min (asked {self.minutes:g}), seed {self.seed}",
            "actions: " + ", ".join(f"{k} {v}" for k, v in sorted(self.actions.items())),
            "tpu-env documents served: " + ", ".join(f"{k} {v}" for k, v in sorted(self.documents.items())),
            f"hotplug add/remove cycles: {self.hotplug_cycles}",
            f"daemon crashes: {len(self.crashes)}",
            f"devices left unbound after their events settled: {len(self.lost_devices)}",
            f"tpu-env reads: {self.reader.get('reads', 0)}; missing {self.reader.get('missing', 0)}, "
            f"garbled {self.reader.get('garbled', 0)}, "
            f"values no document gave {self.reader.get('unexpected', 0)}",
            f"tpu-env still wrong {FILE_SETTLE_S:.0f} s after faults cleared: {len(self.wrong_file)}; "
            f"right again after a change or a cleared fault in median {median:.1f} s, "
            f"at most {max(settle, default=0.0):.1f} s ({len(settle)} times)",
            f"vBar: longest down {self.vbar_longest_down_s:.0f} s (sampled every {SAMPLE_EVERY_S:.0f} s); "
            f"running at the end: {'yes' if self.vbar_running_at_end else 'NO'}",
            f"tpuboot growth per hour over {self.growth.hours:.2f} h of process life "
            f"({self.growth.samples} samples): fds {self.growth.fds:+.1f}, "
            f"threads {self.growth.threads:+.1f}, "
            f"RSS {self.growth.rss_kib:+.0f} KiB",
            f"the longest-lived tpuboot process ({self.longest.minutes:.1f} min), first -> last sample: "
            f"fds {self.longest.first[0]} -> {self.longest.last[0]}, "
            f"threads {self.longest.first[1]} -> {self.longest.last[1]}, "
            f"RSS {self.longest.first[2]} -> {self.longest.last[2]} KiB",
            *self.render_lives(),
            f"temporary files left behind: {len(self.leftover_temps)}",
            "error and warning lines by kind:",
            *(f"  {n:5d}  {kind}" for kind, n in sorted(self.errors_by_kind.items(), key=lambda kv: -kv[1])),
        ]
        failures = self.failures()
        lines.append("verdict: " + ("CLEAN" if not failures else f"{len(failures)} FAILURES"))
        lines += [f"  - {f}" for f in failures]
        return "\n".join(lines)


@dataclass(frozen=True)
class Served:
    """A document put to the emulator: when in the soak's time (once its PUT returned), and the
    guest's CLOCK_MONOTONIC, the reader's clock, just before the PUT went and once its answer came.
    A read is placed before or after a document by the guest's clock, not by when the soak got
    round to noting the document."""

    label: str
    soak_s: float
    guest_from: float | None = None  # None: the document the guest booted with
    guest_to: float | None = None


def explain_streak(
    streak: dict[str, Any], reader_started: float, served: Sequence[Served], reader_clock: float | None = None
) -> str:
    """A streak of the reader's (``bench/soak_reader.py``) in words: when in the soak's time, how
    long, the document it is nearest to and what differs, and the last two documents ``served``
    before its first read, each with its time and one whose PUT was still under way flagged. With
    ``reader_clock`` (the guest's CLOCK_MONOTONIC when the reader's clock started) the order is the
    guest's; without it, the soak's (the reader's clock starts at ``reader_started``, give or take
    its start-up)."""
    first = reader_started + streak["first_at_s"]
    last = reader_started + streak["last_at_s"]
    at = first
    if reader_clock is not None:
        at = reader_clock + streak["first_at_s"]
        timed = [s for s in served if s.guest_to is not None and s.guest_to <= at]
        if timed:  # the soak's time of the streak from the last document's offset between the clocks
            first = timed[-1].soak_s + (at - timed[-1].guest_to)
            last = first + streak["last_at_s"] - streak["first_at_s"]
    what = (
        "the same values"
        if not streak["differs"]
        else f"{streak['differs']} names differ: " + ", ".join(streak["names"])
    )
    if reader_clock is None:
        before = [f"{s.label!r} at {s.soak_s:.0f} s" for s in served if s.soak_s <= first][-2:]
    else:
        before = [
            f"{s.label!r} at {s.soak_s:.0f} s"
            + (" (its PUT under way)" if s.guest_to is not None and s.guest_to > at else "")
            for s in served
            if s.guest_from is None or s.guest_from <= at
        ][-2:]
    return (
        f"{first:.0f}-{last:.0f} s ({streak['reads']} reads): nearest {streak['closest']!r} ({what}); "
        f"served last before: {', '.join(before) or 'nothing'}"
    )


def pooled_slope(samples: Sequence[tuple[int, float, float]]) -> tuple[float, int, float]:
    """Slope per hour of value over time within each process (pid), pooled: a restart's drop back
    to the start-up level is not growth. Returns (slope per hour, samples used, hours covered)."""
    by_pid: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for pid, t, v in samples:
        by_pid[pid].append((t, v))
    num = den = hours = 0.0
    used = 0
    for points in by_pid.values():
        if len(points) < 3:
            continue
        mt = sum(t for t, _ in points) / len(points)
        mv = sum(v for _, v in points) / len(points)
        num += sum((t - mt) * (v - mv) for t, v in points)
        den += sum((t - mt) ** 2 for t, _ in points)
        hours += (points[-1][0] - points[0][0]) / 3600
        used += len(points)
    return (num / den * 3600 if den else 0.0), used, hours


_NOISE = [
    (re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"), "DBDF"),
    (re.compile(r"'[^']*'|\"[^\"]*\""), "'…'"),
    (re.compile(r"[0-9a-f]{12,}"), "HEX"),
    (re.compile(r"\d+(\.\d+)?"), "N"),
]


def error_kind(message: str) -> str:
    """A log line with its addresses, quoted values and numbers blanked, cut to 100 characters."""
    text = message.splitlines()[0] if message else ""
    for pattern, replacement in _NOISE:
        text = pattern.sub(replacement, text)
    return text[:100]


# --------------------------------------------------------------------------- the campaign


class Soak:
    """One campaign on a booted guest; :meth:`run` returns the report."""

    def __init__(self, vm: VM, minutes: float, seed: int, life_minutes: float | None = None) -> None:
        self.vm = vm
        self.minutes = minutes
        self.life_minutes = life_minutes  # long-life mode: tpuboot restarted only this often
        self.rng = random.Random(seed)
        self.report = SoakReport(minutes=minutes, seed=seed, life_minutes=life_minutes)
        self.actions: collections.Counter[str] = collections.Counter()
        self.documents: collections.Counter[str] = collections.Counter()
        self.hot: dict[str, str] = {}  # QMP id -> guest address
        self.serial = 0
        self.fault: str | None = None
        self.fault_until = 0.0
        self.served = CATALOG[0]  # what the emulator serves
        self.served_at: list[Served] = [Served(CATALOG[0].label, 0.0)]
        self.reader_started = 0.0  # soak time: the reader's clock starts about then
        self.want = BASE  # the values the file must come to hold
        self.want_since: float | None = time.monotonic()
        self.kills = 0
        self.last_lifecycle = self.last_dockerd = -1e9
        self.samples: list[tuple[int, float, int, int, int]] = []  # pid, t, fds, threads, RSS KiB
        self.maps: list[tuple[int, float, int, int, int, int]] = []  # pid, t, RSS KiB per MAPPINGS
        self.last_sample = -1e9
        self.vbar_down_since: float | None = None
        self.unbound_since: dict[str, float] = {}
        self.started = time.monotonic()
        self.life_started = self.started

    # -- guest helpers -------------------------------------------------------------------------

    def sh(self, command: str, timeout: float = 120.0) -> str:
        return self.vm.run(command, timeout=timeout, check=True).stdout

    def put(self, path: str, body: str, pad: int = 0) -> tuple[float, float]:
        """PUT to the emulator; the guest's CLOCK_MONOTONIC before it went and once it was answered."""
        url = f"http://127.0.0.1:{MDS_PORT}/_emulator/{path}"
        result = self.vm.run(
            ["python3", "-c", PUT, url, str(pad)], stdin=body.encode(), timeout=60, check=True
        )
        sent, answered = result.stdout.split()
        return float(sent), float(answered)

    def stand_ins(self) -> dict[str, str | None]:
        return {d.address: d.driver for d in self.vm.pci_devices(*EDU)}

    # -- set-up and the end ----------------------------------------------------------------------

    def start_reader(self) -> None:
        self.vm.write_file(READER_CATALOG, json.dumps(reader_catalog()))
        self.reader_started = self.elapsed()
        self.sh(
            f"systemd-run --unit={READER_UNIT} --property=Nice=-5 "
            f"/usr/bin/python3 {READER} {READER_CATALOG} {TPU_ENV_FILE} {READER_OUT}"
        )

    def stop_reader(self) -> dict[str, Any]:
        self.sh(f"systemctl stop {READER_UNIT}")
        return json.loads(self.vm.read_file(READER_OUT))

    def wait_ready(self) -> None:
        self.vm.wait_until("systemctl is-active -q tpuboot", timeout=180, interval=0.5)

    def run(self) -> SoakReport:
        self.wait_ready()
        self.start_reader()
        deadline = self.started + self.minutes * 60
        moves = self.moves()
        self.life_started = time.monotonic()
        while time.monotonic() < deadline:
            self.tick()
            if self.life_over(deadline):
                log.info("%5.0f s: a life of %g min is over: restart", self.elapsed(), self.life_minutes)
                self.actions["tpuboot restart (end of a life)"] += 1
                self.lifecycle("restart")
                self.life_started = time.monotonic()
            name, move = self.choose(moves)
            log.info("%5.0f s: %s", time.monotonic() - self.started, name)
            self.actions[name] += 1
            move()
            self.tick()
            time.sleep(self.rng.uniform(0.2, 2.0))
        self.settle()
        return self.finish()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def life_over(self, deadline: float) -> bool:
        """Long-life mode: this life has had its minutes, and another whole one fits before the end."""
        if self.life_minutes is None:
            return False
        life = self.life_minutes * 60
        now = time.monotonic()
        return now - self.life_started >= life and deadline - now >= life

    def settle(self) -> None:
        """Clear every fault, then wait for the file, the devices and vBar to come right."""
        self.clear_fault()
        self.wait_ready()
        end = time.monotonic() + max(FILE_SETTLE_S, VBAR_SETTLE_S)
        while time.monotonic() < end:
            self.tick(force_sample=True)
            vbar = self.vbar_running()
            if self.want_since is None and vbar and not self.unbound_since:
                break
            time.sleep(2)
        if self.want_since is not None:
            self.report.wrong_file.append(f"at the end: {self.file_problem()}")
            self.want_since = None
        for address, since in self.unbound_since.items():
            unbound = time.monotonic() - since
            self.report.lost_devices.append(f"{address}, unbound for {unbound:.0f} s at the end")
        self.report.vbar_running_at_end = self.vbar_running()

    def finish(self) -> SoakReport:
        r = self.report
        r.reader = self.stop_reader()
        streaks = r.reader.get("streaks", [])
        clock = r.reader.get("clock_started")
        r.unexpected_reads = [explain_streak(s, self.reader_started, self.served_at, clock) for s in streaks]
        r.served = [(round(s.soak_s, 1), s.label) for s in self.served_at]
        r.actions = dict(self.actions)
        r.documents = dict(self.documents)
        r.elapsed_s = time.monotonic() - self.started
        self.read_journal()
        slope = [pooled_slope([(p, t, s[i]) for p, t, *s in self.samples]) for i in range(3)]
        r.growth = Growth(slope[0][0], slope[1][0], slope[2][0], slope[0][1], slope[0][2])
        r.longest = longest_life(self.samples)
        r.lives = life_growth(self.samples, maps=self.maps) if self.life_minutes is not None else []
        r.samples, r.maps = self.samples, self.maps
        temps = self.sh(f"find {TEMP_DIRS} -maxdepth 1 -name '.*.tpuboot-*' || true")
        r.leftover_temps = temps.split()
        return r

    def read_journal(self) -> None:
        """Crashes as systemd saw them, and tpuboot's own warnings and errors by kind."""
        out = self.sh("journalctl -b -u tpuboot -o json --output-fields=MESSAGE,PRIORITY,SYSLOG_IDENTIFIER")
        exits, kinds = [], collections.Counter[str]()
        for line in out.splitlines():
            entry = json.loads(line)
            message = entry.get("MESSAGE")
            if not isinstance(message, str):
                message = bytes(message or []).decode(errors="replace")
            if entry.get("SYSLOG_IDENTIFIER") == "systemd":
                if any(what in message for what in SYSTEMD_EXITS):
                    exits.append(message)
            elif int(entry.get("PRIORITY", 6)) <= 4:
                kinds[error_kind(message)] += 1
        killed = [m for m in exits if "status=9/KILL" in m]
        self.report.crashes += [m for m in exits if "status=9/KILL" not in m]
        if len(killed) != self.kills:
            self.report.crashes.append(f"{len(killed)} SIGKILL exits seen, the soak sent {self.kills}")
        self.report.errors_by_kind = dict(kinds)

    # -- what is checked between moves -------------------------------------------------------

    def tick(self, force_sample: bool = False) -> None:
        now = time.monotonic()
        if self.fault is not None and now >= self.fault_until:
            self.clear_fault()
        self.check_file(now)
        if force_sample or now - self.last_sample >= SAMPLE_EVERY_S:
            self.last_sample = now
            self.sample(now)

    def check_file(self, now: float) -> None:
        if self.want_since is None or self.fault is not None:
            return
        if self.file_problem() is None:
            self.report.file_settle_s.append(round(now - self.want_since, 1))
            self.want_since = None
        elif now - self.want_since > FILE_SETTLE_S:
            self.report.wrong_file.append(f"{now - self.started:.0f} s: {self.file_problem()}")
            self.want_since = None

    def file_problem(self) -> str | None:
        result = self.vm.run(["cat", TPU_ENV_FILE], timeout=60)
        if not result.ok:
            return f"unreadable: {result.stderr.strip()}"
        values = parse_env_text(result.stdout_bytes.decode("utf-8", errors="replace"))
        if values == self.want:
            return None
        got = "garbled" if values is None else f"WORKER_ID={values.get('WORKER_ID')!r}, {len(values)} keys"
        return f"holds {got}; wanted WORKER_ID={self.want.get('WORKER_ID')!r}, {len(self.want)} keys"

    def sample(self, now: float) -> None:
        fields = self.sh(PROBE).split()
        if len(fields) == 4 + len(MAPPINGS):  # /proc/PID/status lists VmRSS before Threads
            pid, fds, rss, threads, heap, anon, files, other = (int(f) for f in fields)
            self.samples.append((pid, now - self.started, fds, threads, rss))
            self.maps.append((pid, now - self.started, heap, anon, files, other))
        running = self.vbar_running()
        if running:
            if self.vbar_down_since is not None:
                down = now - self.vbar_down_since
                self.report.vbar_longest_down_s = max(self.report.vbar_longest_down_s, down)
            self.vbar_down_since = None
        elif self.vbar_down_since is None:
            self.vbar_down_since = now
        present = self.stand_ins()
        for address, driver in present.items():
            if driver == "vfio-pci":
                self.unbound_since.pop(address, None)
            elif address not in self.unbound_since:
                self.unbound_since[address] = now
            elif now - self.unbound_since[address] > BIND_SETTLE_S:
                held = driver or "no driver"
                self.report.lost_devices.append(f"{address}: {held} for {BIND_SETTLE_S:.0f} s")
                self.unbound_since[address] = now  # reported once per window
        for address in set(self.unbound_since) - set(present):
            self.unbound_since.pop(address)

    def vbar_running(self) -> bool:
        result = self.vm.run(["docker", "inspect", "-f", "{{.State.Running}}", VBAR], timeout=60)
        return result.ok and result.stdout.strip() == "true"

    # -- the moves -----------------------------------------------------------------------------

    def moves(self) -> list[tuple[str, int, Callable[[], bool], Callable[[], None]]]:
        """(name, weight, possible now, do it)."""
        now = time.monotonic
        return [
            ("hotplug add", 30, lambda: len(self.hot) < HOTPLUG_PORTS, self.hot_add),
            ("hotplug remove", 28, lambda: bool(self.hot), self.hot_remove),
            ("metadata fault", 12, lambda: self.fault is None, self.start_fault),
            ("tpu-env document", 14, lambda: self.fault != "down", self.serve_document),
            ("vBar kill", 5, lambda: True, self.kill_vbar),
            ("dockerd restart", 3, lambda: now() - self.last_dockerd > DOCKERD_GAP_S, self.restart_dockerd),
            ("tpuboot restart", 3, self.lifecycle_allowed, self.restart_tpuboot),
            ("tpuboot SIGKILL", 2, self.lifecycle_allowed, self.kill_tpuboot),
            ("hotplug add while tpuboot is stopped", 2, self.stopped_add_allowed, self.hot_add_while_stopped),
        ]  # fmt: skip

    def choose(
        self, moves: list[tuple[str, int, Callable[[], bool], Callable[[], None]]]
    ) -> tuple[str, Callable[[], None]]:
        possible = [(name, weight, do) for name, weight, allowed, do in moves if allowed()]
        name, _, do = self.rng.choices(possible, weights=[w for _, w, _ in possible])[0]
        return name, do

    def stopped_add_allowed(self) -> bool:
        return self.lifecycle_allowed() and len(self.hot) < HOTPLUG_PORTS

    def lifecycle_allowed(self) -> bool:
        """A restart, stop or kill of tpuboot may come now (never in long-life mode: its lives end
        only on schedule)."""
        return self.life_minutes is None and time.monotonic() - self.last_lifecycle > LIFECYCLE_GAP_S

    def free_port(self) -> str:
        used = set(self.hot.values())
        return self.rng.choice([p for p in self.vm.hotplug_ports if p not in used])

    def hot_add(self, before_bind: Callable[[], None] | None = None) -> None:
        port = self.free_port()
        self.serial += 1
        ident = f"soak{self.serial}"
        before = set(self.stand_ins())
        self.vm.device_add("edu", id=ident, bus=port)
        self.hot[ident] = port
        if before_bind is not None:
            before_bind()
        end = time.monotonic() + BIND_SETTLE_S
        while time.monotonic() < end:
            new = {a: d for a, d in self.stand_ins().items() if a not in before}
            if new and all(d == "vfio-pci" for d in new.values()):
                self.report.hotplug_cycles += 1
                return
            time.sleep(0.3)
        late = f"hot-added {ident} on {port}: not bound within {BIND_SETTLE_S:.0f} s"
        self.report.lost_devices.append(late)

    def hot_remove(self) -> None:
        ident = self.rng.choice(sorted(self.hot))
        try:
            self.vm.device_del(ident, timeout=BIND_SETTLE_S)
        except VMError as exc:
            self.report.lost_devices.append(f"{ident}: the guest never released it ({exc})")
        self.hot.pop(ident)

    def hot_add_while_stopped(self) -> None:
        self.last_lifecycle = time.monotonic()
        self.sh("systemctl stop tpuboot")
        self.hot_add(before_bind=lambda: self.lifecycle("start"))

    def start_fault(self) -> None:
        name = self.rng.choice(sorted(FAULTS))
        fields = FAULTS[name]
        if fields is None:
            self.sh(f"systemctl stop {MDS_UNIT}")
        else:
            self.put("faults", json.dumps(fields))
        self.fault = name
        self.fault_until = time.monotonic() + self.rng.uniform(*FAULT_HOLD_S)

    def clear_fault(self) -> None:
        if self.fault is None:
            return
        if FAULTS[self.fault] is None:
            self.sh(f"systemctl start {MDS_UNIT}")
            self.vm.wait_until(f"python3 -c {shlex.quote(CONNECT)}", timeout=60, interval=0.5)
            # It starts from its attributes file: serve again what was served before it went down.
            self.put("v1/instance/attributes/tpu-env", self.served.text, self.served.pad)
        else:
            self.put("faults", "{}")
        self.fault = None
        if self.want_since is None and self.file_problem() is not None:
            self.want_since = time.monotonic()

    def serve_document(self) -> None:
        settled = self.fault is None and self.want_since is None
        # A refused document leaves the file as it is: only once it holds what is wanted, or
        # the last good document would never have been read.
        doc = self.rng.choice([d for d in CATALOG if settled or d.expected is not None])
        sent, answered = self.put("v1/instance/attributes/tpu-env", doc.text, doc.pad)
        self.served = doc
        self.served_at.append(Served(doc.label, self.elapsed(), sent, answered))
        self.documents[doc.label] += 1
        if doc.expected is not None and doc.expected != self.want:
            self.want = doc.expected
            self.want_since = time.monotonic()

    def kill_vbar(self) -> None:
        self.vm.run(["docker", "kill", VBAR], timeout=60)

    def restart_dockerd(self) -> None:
        self.last_dockerd = time.monotonic()
        self.sh("systemctl restart docker", timeout=240)

    def restart_tpuboot(self) -> None:
        self.last_lifecycle = time.monotonic()
        self.lifecycle("restart")

    def lifecycle(self, verb: str) -> None:
        """``systemctl VERB tpuboot``; a failure is a crash to report, and tpuboot is started again."""
        result = self.vm.run(["systemctl", verb, "tpuboot"], timeout=240)
        if not result.ok:
            state = self.sh("systemctl show -P Result tpuboot").strip()
            why = f"systemctl {verb} tpuboot failed (Result={state}): {result.stderr.strip()}"
            self.report.crashes.append(why)
            self.sh("systemctl reset-failed tpuboot; systemctl start tpuboot", timeout=240)

    def kill_tpuboot(self) -> None:
        self.last_lifecycle = time.monotonic()
        self.kills += 1
        self.sh("systemctl kill -s KILL tpuboot")
        self.wait_ready()


def run_soak(vm: VM, minutes: float, seed: int, life_minutes: float | None = None) -> SoakReport:
    return Soak(vm, minutes, seed, life_minutes).run()


def boot_kwargs() -> dict[str, Any]:
    return {"devices": ["edu"] * COLD_STAND_INS, "hotplug_ports": HOTPLUG_PORTS, "memory": 1536}


@contextmanager
def soak_guest() -> Iterator[VM]:
    """Build the .deb and the image, boot the guest; everything is removed afterwards."""
    artifacts = ensure_artifacts(platform=BOOKWORM)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=cache_dir()))
    try:
        deb = build_deb(work / "deb")
        image = build_image(artifacts, work / "soak.ext4", soak_install_hook(deb))
        with VM.from_artifacts(artifacts, image, name="soak", **boot_kwargs()) as vm:
            vm.wait_booted()
            yield vm
    finally:
        remove_tree(work)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, help="how long to drive faults (default 30; with --life-minutes, one life)"
    )
    parser.add_argument(
        "--life-minutes",
        type=float,
        metavar="M",
        help=f"long lives: restart tpuboot only every M minutes (at least {LONG_LIFE_MIN:g}) and report "
        "each life's growth per hour",
    )
    parser.add_argument("--seed", type=int, help="random seed (default: from the clock, printed)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON to FILE")
    args = parser.parse_args(argv)
    if args.life_minutes is not None and args.life_minutes < LONG_LIFE_MIN:
        parser.error(f"--life-minutes: {args.life_minutes:g} is under {LONG_LIFE_MIN:g}; a shorter life's "
                     "slope is its start-up, not growth")  # fmt: skip
    minutes = args.minutes if args.minutes is not None else (args.life_minutes or 30.0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    seed = args.seed if args.seed is not None else int(time.time())
    with soak_guest() as vm:
        report = run_soak(vm, minutes, seed, args.life_minutes)
    print(report.render())
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
