"""Doctor's ``runtime-metrics``, ``libtpu-hang`` and ``libtpu-slice-error``: what the daemon last
read of the jobs' libtpu (/run/tpuboot/runtime, :mod:`tpuboot.runtime.statefile`), never asked of
libtpu here: doctor says what the daemon's metrics, STATUS and alerts say. NPD's
MegascaleHangDetected and SliceErrorDetected are views of the last two (tpuboot/checks/npd.py).
"""

from __future__ import annotations

import functools
from typing import Any

from tpuboot.atomicfile import FileError
from tpuboot.config import Config
from tpuboot.errors import printable
from tpuboot.paths import Root
from tpuboot.runtime import statefile
from tpuboot.runtime.client import grpc_missing
from tpuboot.verdicts import Check, CheckResult, Criterion, failed, passed, skipped, warned

RESTART = "restart the job from its last checkpoint (its logs say which worker); tpuboot top shows each chip"
RUNTIME_METRICS = Criterion(
    "runtime-metrics", "the libtpu of every job holding a chip answering the daemon's polls"
)
HANG = Criterion("libtpu-hang", "no job's libtpu reporting a hang (its megascale error gauge)")
SLICE_ERROR = Criterion("libtpu-slice-error", "no job's libtpu reporting a slice error")


class RuntimeChecks:
    """The three checks, over one read of the daemon's file."""

    def __init__(self, root: Root, config: Config) -> None:
        self.root = root
        self.config = config

    def named(self) -> list[tuple[Criterion, Check]]:
        return [
            (RUNTIME_METRICS, lambda _: self.check_metrics()),
            (HANG, lambda _: self.check_fault("hang")),
            (SLICE_ERROR, lambda _: self.check_fault("slice_error")),
        ]

    @functools.cached_property
    def state(self) -> tuple[dict[str, Any] | None, CheckResult | None]:
        """The file's data, or the verdict every check gives without it."""
        if not self.config.runtime_metrics.enabled:
            return None, skipped("runtime_metrics.enabled is false: libtpu's metrics are not read")
        missing = grpc_missing()
        if missing is not None:
            return None, skipped(missing)
        try:
            data = statefile.load(self.root)
        except FileError as exc:
            return None, warned(str(exc), f"rm {statefile.RUNTIME_PATH} && systemctl restart tpuboot")
        if data is None:
            return None, skipped("no job's libtpu is polled: no chip is held, or tpuboot run is not running")
        return data, None

    def _ports(self) -> list[dict[str, Any]]:
        data, _ = self.state
        return [p for p in (data or {}).get("ports", []) if isinstance(p, dict)]

    def check_metrics(self) -> CheckResult:
        verdict = self.state[1]
        if verdict is not None:
            return verdict
        ports = self._ports()
        failing = [p for p in ports if p.get("error")]
        if failing:
            said = "; ".join(printable(str(p["error"])) for p in failing)
            return warned(
                f"libtpu does not answer: {said}",
                "journalctl -u tpuboot PORT=... says since when; a job that never answers may be stuck",
            )
        return passed(f"libtpu answers on {_where(ports)}")

    def check_fault(self, kind: str) -> CheckResult:
        verdict = self.state[1]
        if verdict is not None:
            return verdict
        ports = self._ports()
        on = [p for p in ports if (p.get(kind) is not None and p.get(kind) is not False)]
        if not on:
            gauge = "megascale error (hang)" if kind == "hang" else "slice error"
            return passed(f"libtpu's {gauge} gauge is off on {_where(ports)}")
        if kind == "hang":
            return failed(f"libtpu reports a hang (HANG_DETECTED) on {_where(on)}", RESTART)
        message = printable(str(on[0].get("slice_error") or "no message"))
        return failed(f"libtpu reports a slice error on {_where(on)}: {message}", RESTART)


def _where(ports: list[dict[str, Any]]) -> str:
    return (
        ", ".join(
            f"port {p.get('port')} (PID {p.get('pid')}, {printable(str(p.get('holder')))})" for p in ports
        )
        or "no port"
    )
