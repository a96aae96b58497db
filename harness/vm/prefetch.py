"""``python -m harness.vm.prefetch [PLATFORM...]``: build (or find) the cached kernel, initramfs and
guest tree of every platform the VM tests boot (:data:`TESTED`), or of those named.

scripts/test runs it beside the unit tests, so that the QEMU phase after them finds its slowest,
mostly downloading and unpacking steps done (debootstrap of five trees, the kernel packages: about
ten minutes of a clean clone's run, more on a slow mirror). Best effort: a host that cannot run VM
tests, or a build that fails, is said in one line and left to the QEMU phase, which builds what is
missing itself and fails there with the same error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from harness.vm import hostenv
from harness.vm.artifacts import (
    BOOKWORM,
    DOCKER_TRIXIE,
    GRPC_BOOKWORM,
    PODMAN_BOOKWORM,
    TRIXIE,
    Platform,
    ensure_artifacts,
    platform_named,
)
from harness.vm.hostenv import HostError

#: Every platform tests/vm boots (tests/unit/harness/test_prefetch.py holds this to what they name).
TESTED: tuple[Platform, ...] = (BOOKWORM, TRIXIE, PODMAN_BOOKWORM, DOCKER_TRIXIE, GRPC_BOOKWORM)


def prefetch(platforms: Sequence[Platform]) -> list[str]:
    """Each platform's artifacts built or found, in order; the one-line failures."""
    failures = []
    for platform in platforms:
        started = time.monotonic()
        try:
            ensure_artifacts(platform=platform)
        except (HostError, OSError) as exc:
            failures.append(
                f"{platform.name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            )
            continue
        print(f"{platform.name}: ready in {time.monotonic() - started:.0f} s", flush=True)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.vm.prefetch", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "platforms", nargs="*", metavar="PLATFORM", help="e.g. debian12 (default: every one tested)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    try:
        platforms = [platform_named(name) for name in args.platforms] or list(TESTED)
    except ValueError as exc:
        parser.error(str(exc))
    problem = hostenv.host_problem()
    if problem:
        print(f"no VM artifacts prefetched: {problem}")
        return 0
    failures = prefetch(platforms)
    for failure in failures:
        print(f"not prefetched (the QEMU tests build it again): {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
