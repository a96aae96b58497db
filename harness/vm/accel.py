"""Choose QEMU's accelerator by booting, not by looking at /dev/kvm.

On the CI machines /dev/kvm exists but a KVM guest hangs after real-mode setup,
so only a real boot tells. The probe boots the bench's kernel and initramfs
with ``tpuboot.probe=1``: the initramfs prints a marker and powers off at once.
KVM is chosen only if that marker shows within :data:`PROBE_TIMEOUT` seconds.
``$TPUBOOT_VM_ACCEL=kvm|tcg`` skips the probe. The answer is kept per process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from .artifacts import PROBE_MARKER
from .hostenv import QEMU

log = logging.getLogger("tpuboot.vm")

ACCEL_ENV = "TPUBOOT_VM_ACCEL"
ACCELS = ("kvm", "tcg")
PROBE_TIMEOUT = 4.0

_lock = threading.Lock()
_chosen: str | None = None


def accel_args(accel: str) -> list[str]:
    """QEMU arguments for ``accel`` (multi-threaded TCG: one host thread per vCPU)."""
    if accel == "kvm":
        return ["-accel", "kvm"]
    if accel == "tcg":
        return ["-accel", "tcg,thread=multi"]
    raise ValueError(f"unknown accelerator {accel!r}; expected one of {ACCELS}")


def probe(accel: str, kernel: Path, initrd: Path, timeout: float = PROBE_TIMEOUT) -> bool:
    """True if a guest under ``accel`` reaches the initramfs and prints the marker in time."""
    argv = [
        QEMU, "-machine", "q35", *accel_args(accel), "-nodefaults", "-display", "none", "-no-reboot",
        "-m", "256", "-kernel", str(kernel), "-initrd", str(initrd),
        "-append", "console=ttyS0 tpuboot.probe=1 panic=-1", "-serial", "stdio",
    ]  # fmt: skip
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
        output = proc.stdout
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed QEMU
        output = exc.stdout or b""
    ok = PROBE_MARKER.encode() in output
    log.info(
        "accelerator probe %s: %s in %.1fs", accel, "ok" if ok else "no marker", time.monotonic() - start
    )
    return ok


def select_accel(kernel: Path, initrd: Path) -> str:
    """``kvm`` or ``tcg`` for this process: the environment's choice, else a probe boot."""
    global _chosen
    forced = os.environ.get(ACCEL_ENV, "").strip().lower()
    if forced:
        if forced not in ACCELS:
            raise ValueError(f"{ACCEL_ENV}={forced!r}: expected one of {ACCELS}")
        return forced
    with _lock:
        if _chosen is None:
            usable = os.access("/dev/kvm", os.R_OK | os.W_OK)
            _chosen = "kvm" if usable and probe("kvm", kernel, initrd) else "tcg"
            log.info("accelerator: %s", _chosen)
        return _chosen
