"""`tpuboot npd CONDITION`: doctor's judgements in node-problem-detector's custom-plugin language.

NPD (Kubernetes' node-problem-detector) runs a plugin every ``invoke_interval`` and reads its exit
status, 0 OK, 1 a problem, 2 unknown, and the first ``max_output_length`` (80) bytes of its stdout
as the message; a permanent rule turns that into a NodeCondition, a temporary one into an Event.
Each condition here is a thin view, never a second judgement: the permanent ones on doctor's
checks (their FAIL is the problem, their detail the message), the temporary one on the reset
breaker's record (:class:`tpuboot.devices.reset.Breaker`), which every reset, `tpuboot reset`'s
or recovery.automatic's, writes before it climbs.

:data:`CONDITIONS` is the one list: the command's choices, the JSON configs shipped under
/usr/share/tpuboot/node-problem-detector/ (:func:`plugin_configs`; tests/unit/checks/test_npd.py
holds the files in conf/ to them) and doc/kubernetes.md's table (checked there too). Adding a
condition is one entry.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tpuboot.atomicfile import FileError, read_file, write_file
from tpuboot.checks.containers import ContainerProbe, answering, engine_container_state, running
from tpuboot.checks.doctor import CHIP_COUNT, TPUS_BOUND, Doctor, MetadataReader, metadata_lookup
from tpuboot.checks.holders import CHIP_HOLDERS, main_pid
from tpuboot.checks.notices import MAINTENANCE_NOTICE
from tpuboot.checks.parsers.systemd import Systemd
from tpuboot.checks.pcie import PCIE_HEALTH
from tpuboot.checks.runtime import HANG, SLICE_ERROR
from tpuboot.config import Config
from tpuboot.containers.agents import VBAR_AGENT
from tpuboot.containers.liveness import EndpointProbe, probe
from tpuboot.devices.pci import PCI_DEVICES
from tpuboot.devices.reset import Breaker
from tpuboot.errors import printable
from tpuboot.notices import noticefile
from tpuboot.numbers import ascii_decimal
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion

OK, PROBLEM, UNKNOWN = 0, 1, 2
#: NPD's default message length; the configs set it, the command keeps within it.
MAX_OUTPUT = 80
INVOKE_INTERVAL = "30s"
PLUGIN_TIMEOUT = "5s"
#: Each rule's own timeout, within the plugin's.
RULE_TIMEOUT = "4s"
TPUBOOT = "/usr/bin/tpuboot"
#: The newest reset NPD has been told of (seconds since the epoch): a reset newer than it is an
#: event once. Root's, beside the breaker's record, so a reboot does not tell the same reset again.
SEEN_PATH = "/var/lib/tpuboot/npd-resets-seen"
#: How long the vBar condition waits for the metadata server (is this a GKE node?).
METADATA_DEADLINE = 1.0
DAEMON_UNIT = "tpuboot.service"


@dataclass(frozen=True)
class Answer:
    """What NPD reads of one run: the exit status and the message."""

    status: int
    message: str

    @property
    def line(self) -> str:
        return one_line(self.message)


class Look:
    """What one run of a rule reads, each once: the doctor for this root, whether the daemon runs."""

    def __init__(
        self,
        root: Root,
        config: Config,
        *,
        metadata: MetadataReader | None = None,
        asks_metadata: bool = False,
        systemd: Systemd | None = None,
        container_state: ContainerProbe = engine_container_state,
        endpoint_probe: EndpointProbe = probe,
    ) -> None:
        self.root = root
        self.config = config
        self.systemd = systemd or Systemd()
        self.asks_metadata = asks_metadata  # its checks need the server's answer (else not asked)
        self.doctor = Doctor(
            root,
            config,
            metadata=metadata,
            container_state=container_state,
            endpoint_probe=endpoint_probe,
            metadata_deadline=METADATA_DEADLINE,
            systemd=self.systemd,
        )

    def check(self, criterion: Criterion) -> CheckResult:
        """Doctor's check of ``criterion``, run as it is: what it raises is raised (unknown, not a
        FAIL)."""
        return self.doctor.checks[criterion.name](self.root)

    def daemon_running(self) -> bool:
        """tpuboot.service's main process is alive (systemctl on the host, its cgroup in a tree)."""
        pid = main_pid(self.root, DAEMON_UNIT, self.systemd)
        return pid is not None and self.root.path(f"/proc/{pid}").is_dir()


Judge = Callable[[Look], Answer]


def doctor_view(*checks: Criterion, supervised: str | None = None) -> Judge:
    """A condition that is doctor's ``checks``: a FAIL is the problem (its detail the message);
    all SKIP is OK ("not judged here"), unless a SKIP is for want of the metadata server's answer
    (unknown). ``supervised``: what is judged is kept running by tpuboot's daemon, so a judgement
    made while the daemon is stopped holds only until it stops: unknown."""

    def judge(look: Look) -> Answer:
        results = [look.check(criterion) for criterion in checks]
        judged = [r for r in results if r.status != "SKIP"]
        if not judged:
            if look.asks_metadata and look.doctor.metadata.down is not None:
                return Answer(UNKNOWN, f"cannot tell: {results[0].detail}")
            return Answer(OK, f"not judged here: {results[0].detail}")
        if supervised is not None and not look.daemon_running():
            return Answer(
                UNKNOWN, f"tpuboot is not running to supervise {supervised}: systemctl start tpuboot"
            )
        fails = [r for r in judged if r.status == "FAIL"]
        if fails:
            return Answer(PROBLEM, fails[0].detail)
        warns = [r for r in judged if r.status == "WARN"]
        return Answer(OK, f"doubt: {warns[0].detail}" if warns else judged[0].detail)

    judge.__doc__ = f"doctor's {', '.join(criterion.name for criterion in checks)}"
    return judge


def reset_events(look: Look) -> Answer:
    """A problem once per reset: the breaker's record (every reset's, by hand or recovery.automatic,
    the last hour's) against :data:`SEEN_PATH`, the newest reset already told."""
    breaker = Breaker(look.root, look.config.recovery.max_resets_per_hour)
    seen = ascii_decimal((read_file(look.root, SEEN_PATH, limit=64) or b"").strip()) or 0.0
    new = sorted((t, chip) for chip in breaker.chips() for t in breaker.recent(chip) if t > seen)
    if not new:
        return Answer(OK, "no TPU chip reset since the last look")
    newest, chip = new[-1]
    write_file(look.root, SEEN_PATH, f"{newest!r}\n".encode(), mode=0o644)
    when = datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).strftime("%H:%M:%S UTC")
    if len(new) == 1:
        return Answer(PROBLEM, f"chip {chip} was reset at {when} (tpuboot reset or recovery.automatic)")
    chips = sorted({c for _, c in new})
    return Answer(PROBLEM, f"{len(new)} resets since the last look, the last at {when}: {', '.join(chips)}")


def notice_view(look: Look) -> Answer:
    """Doctor's ``maintenance-notice`` (the daemon's /run/tpuboot/notice): a notice is the problem
    (doctor's WARN: the host is fine until it goes, but the scheduler must place nothing new);
    no file while notices are watched is unknown (the daemon is not running to hear the server)."""
    result = look.check(MAINTENANCE_NOTICE)
    if result.status == "PASS":
        return Answer(OK, result.detail)
    if result.status == "SKIP":
        return Answer(OK if not look.config.notices.enabled else UNKNOWN, result.detail)
    try:
        data = noticefile.load(look.root)
    except FileError as exc:
        return Answer(UNKNOWN, str(exc))
    return Answer(PROBLEM if data and noticefile.active(data) else UNKNOWN, result.detail)


@dataclass(frozen=True)
class Condition:
    """One rule: ``name`` is the command's argument; ``type`` the NodeCondition's (permanent
    rules) and ``reason`` what it says when the rule finds a problem; ``healthy`` the reason and
    message of the condition when all is well (NPD's default). ``metadata``: it may ask the
    metadata server (is this a GKE node?)."""

    name: str
    kind: Literal["permanent", "temporary"]
    type: str
    reason: str
    healthy: tuple[str, str]
    judge: Judge
    fix: str
    metadata: bool = False


CONDITIONS: tuple[Condition, ...] = (
    Condition(
        "chips",
        "permanent",
        "TPUChipsMissing",
        "TPUChipsMissingOrUnbound",
        ("TPUChipsPresent", "every TPU chip is present and bound"),
        doctor_view(TPUS_BOUND, CHIP_COUNT),
        "tpuboot status; tpuboot bind DBDF or systemctl restart tpuboot; a missing chip: repair the VM",
    ),
    Condition(
        "pcie",
        "permanent",
        "TPUPCIeProblem",
        "TPUPCIeLostFatalOrDegraded",
        ("TPUPCIeHealthy", "every TPU function answers, no fatal PCIe error, links at speed"),
        doctor_view(PCIE_HEALTH),
        "tpuboot reset DBDF (or recovery.automatic); a link at half speed: stop and start the VM",
    ),
    Condition(
        "holders",
        "permanent",
        "TPUHeldByStoppedProcess",
        "TPUChipHeldByStoppedOrZombie",
        ("TPUChipsNotHeldByStuckProcess", "no TPU chip held by a stopped or zombie process"),
        doctor_view(CHIP_HOLDERS),
        "kill -CONT PID, end the zombie's parent, or tpuboot release --kill",
    ),
    Condition(
        "vbar",
        "permanent",
        "TPUVbarUnreachable",
        "TPUVbarNotAnswering",
        ("TPUVbarAnswering", "vBar runs and answers, or is not tpuboot's to run here"),
        doctor_view(running(VBAR_AGENT), answering(VBAR_AGENT), supervised=VBAR_AGENT.called),
        "systemctl restart tpuboot; journalctl -u tpuboot AGENT=vBar says why it stopped",
        metadata=True,
    ),
    Condition(
        "maintenance",
        "permanent",
        "TPUHostGoingAway",
        "TPUHostMaintenanceOrPreemption",
        ("TPUNoMaintenanceNotice", "no maintenance or preemption notice from the metadata server"),
        notice_view,
        "checkpoint the job and drain the node (kubectl drain): the VM goes away (doc/notices.md)",
    ),
    Condition(
        "libtpu",
        "permanent",
        # GKE's device plugin sets MegascaleHangDetected and SliceErrorDetected on its nodes: a
        # name of tpuboot's own, so that two writers never flap one condition.
        "TPULibtpuFault",
        "TPULibtpuHangOrSliceError",
        ("TPULibtpuHealthy", "libtpu reports no hang and no slice error, or no job holds a chip"),
        doctor_view(HANG, SLICE_ERROR, supervised="libtpu's runtime metrics"),
        "restart the job from its last checkpoint; journalctl -u tpuboot FAULT=hang (doc/runtime-metrics.md)",
    ),
    Condition(
        "chip-reset",
        "temporary",
        "",
        "TPUChipReset",
        ("", ""),
        reset_events,
        "none needed once back; journalctl -u tpuboot DBDF=... says which rung brought it back",
    ),
)
BY_NAME = {c.name: c for c in CONDITIONS}


def one_line(text: str) -> str:
    """``text`` as NPD may show it: printable ASCII (:func:`printable`, other characters as
    escapes), at most :data:`MAX_OUTPUT` bytes, cut between escapes and ending in ``...`` when cut."""
    parts = [printable(char).encode("ascii", "backslashreplace").decode("ascii") for char in text]
    if sum(map(len, parts)) <= MAX_OUTPUT:
        return "".join(parts)
    kept, size = [], 0
    for part in parts:
        if size + len(part) > MAX_OUTPUT - 3:
            break
        kept.append(part)
        size += len(part)
    return "".join(kept) + "..."


def judge(
    root: Root,
    config: Config,
    condition: Condition,
    *,
    metadata: MetadataReader | None = None,
    systemd: Systemd | None = None,
    container_state: ContainerProbe = engine_container_state,
    endpoint_probe: EndpointProbe = probe,
) -> Answer:
    """``condition``'s answer for this root: unknown when sysfs cannot be read (every condition is
    about the chips on it); the keywords reach :class:`Look` (a test's probes)."""
    try:
        os.listdir(root.path(PCI_DEVICES))
    except OSError as exc:
        return Answer(UNKNOWN, f"cannot read {PCI_DEVICES}: {exc.strerror or exc}")
    if condition.metadata and root.is_host and metadata is None:
        metadata = metadata_lookup(config.metadata)
    look = Look(
        root,
        config,
        metadata=metadata,
        asks_metadata=condition.metadata,
        systemd=systemd,
        container_state=container_state,
        endpoint_probe=endpoint_probe,
    )
    return condition.judge(look)


#: How NPD in a container reaches the host's tpuboot (examples/kubernetes/): chroot into the host's
#: root, mounted at /host, then run tpuboot there with the host's Python.
CHROOT = ("/usr/sbin/chroot", "/host")


def for_rule(condition: Condition, answer: Answer) -> Answer:
    """``answer`` as ``condition``'s rule must report it: NPD makes an event of a temporary rule's
    every status from 1 up, unknown too (custom_plugin_monitor.go), so a temporary rule that
    cannot tell says so with status 0: a reset nobody saw must not become a TPUChipReset event."""
    if condition.kind == "temporary" and answer.status == UNKNOWN:
        return Answer(OK, f"unknown: {answer.message}")
    return answer


def plugin_configs(through: Sequence[str] = ()) -> dict[str, dict[str, object]]:
    """The custom-plugin-monitor configs, by file name: the permanent conditions in one, the
    temporary events in another (each loaded with --config.custom-plugin-monitor). ``through``:
    the command (and its arguments) that runs /usr/bin/tpuboot, for NPD outside the host's root."""
    return {
        "tpu-conditions.json": _plugin_config(
            "tpuboot-conditions", [c for c in CONDITIONS if c.kind == "permanent"], through
        ),
        "tpu-events.json": _plugin_config(
            "tpuboot-events", [c for c in CONDITIONS if c.kind == "temporary"], through
        ),
    }


def _plugin_config(source: str, conditions: Sequence[Condition], through: Sequence[str]) -> dict[str, object]:
    return {
        "plugin": "custom",
        "pluginConfig": {
            "invoke_interval": INVOKE_INTERVAL,
            "timeout": PLUGIN_TIMEOUT,
            "max_output_length": MAX_OUTPUT,
            "concurrency": 1,
            "enable_message_change_based_condition_update": False,
        },
        "source": source,
        "metricsReporting": True,
        "conditions": [
            {"type": c.type, "reason": c.healthy[0], "message": c.healthy[1]}
            for c in conditions
            if c.kind == "permanent"
        ],
        "rules": [_rule(c, through) for c in conditions],
    }


def _rule(c: Condition, through: Sequence[str]) -> dict[str, object]:
    rule: dict[str, object] = {"type": c.kind}
    if c.kind == "permanent":
        rule["condition"] = c.type
    path, *args = [*through, TPUBOOT, "npd", c.name]
    rule.update(reason=c.reason, path=path, args=args, timeout=RULE_TIMEOUT)
    return rule
