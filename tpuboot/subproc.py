"""The one place tpuboot runs a command to completion, so every call is bounded and its failure is
one line. Two others start processes of their own kind: a supervised agent under the exec runtime
(tpuboot/containers/exec.py, long-lived) and a notice hook (tpuboot/notices/hooks.py: its own
process group, a user, cancelled by the daemon's stop)."""

from __future__ import annotations

from collections.abc import Sequence

from tpuboot.errors import TimedOut, TpubootError


def run(argv: Sequence[str], timeout: float = 30.0) -> str:
    """Run ``argv``, return its stdout; raise TpubootError with its last stderr line on failure."""
    import subprocess  # rarely needed (vfio-pci is usually loaded): keeps it out of start-up

    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise TpubootError(f"{argv[0]} not found; install it (Debian package kmod for modprobe)") from None
    except subprocess.TimeoutExpired:
        raise TimedOut(f"{' '.join(argv)} did not finish in {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise TpubootError(f"{' '.join(argv)} failed: {why}")
    return done.stdout
