"""Every test has a deadline: a test still running past it has every thread's stack printed to the
run's stderr and its process ended, so a hang fails one test, with the place it hung, instead of
holding a whole CI run until the CI's own limit kills it with nothing said.

The deadline covers the test's setup, call and teardown (the fixtures it is the first or last to
use included): :data:`UNIT_DEADLINE_S` for a unit test; for a QEMU test, the limit of its call
(:func:`vm_call_limit`, which tests/vm/conftest.py enforces with an exception and the guests'
logs) and :data:`VM_SETUP_S` more. ``$TPUBOOT_TEST_DEADLINE`` (seconds) sets every test's.
The stacks come from faulthandler's own thread, which needs no GIL, so a test hung while holding
it is seen too. Under pytest-xdist the worker's end fails that test ("worker crashed while running
..."), a new worker takes the rest; a run without workers stops there.
The dump goes to a copy of the process's stderr taken at start-up: pytest's capture points fd 2
elsewhere while a test runs, and an xdist worker's stderr is the run's.
SIGUSR2 prints every pytest process's stacks the same way and ends none: scripts/test sends it to a
part that runs past its budget, a hang outside any test included, before it ends the part.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Generator

import pytest

#: Seconds: a unit test that takes ten minutes is hung, not slow (a whole unit run takes 5 to 8).
UNIT_DEADLINE_S = 600.0
#: Seconds a QEMU test may take beyond its call's limit: its setup may build a guest's tree (a
#: debootstrap) and boot it, its teardown shuts guests down.
VM_SETUP_S = 1800.0
DEADLINE_ENV = "TPUBOOT_TEST_DEADLINE"
VM_CALL_LIMIT_ENV = "TPUBOOT_VM_TEST_TIMEOUT"
VM_CALL_LIMIT_S = 600.0
_dump_fd = pytest.StashKey[int]()  # the copy of stderr the stacks go to


def vm_call_limit(item: pytest.Item) -> float:
    """Seconds a QEMU test's call may take: ``@pytest.mark.vm(timeout=N)``, else
    ``$TPUBOOT_VM_TEST_TIMEOUT``, else :data:`VM_CALL_LIMIT_S`."""
    marker = item.get_closest_marker("vm")
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(os.environ.get(VM_CALL_LIMIT_ENV, VM_CALL_LIMIT_S))


def deadline(item: pytest.Item) -> float:
    """The item's deadline in seconds."""
    if DEADLINE_ENV in os.environ:
        return float(os.environ[DEADLINE_ENV])
    if item.get_closest_marker("vm") is None:
        return UNIT_DEADLINE_S
    return vm_call_limit(item) + VM_SETUP_S


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_dump_fd] = os.dup(2)
    faulthandler.register(signal.SIGUSR2, file=config.stash[_dump_fd], all_threads=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.unregister(signal.SIGUSR2)
    os.close(config.stash[_dump_fd])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    faulthandler.dump_traceback_later(deadline(item), exit=True, file=item.config.stash[_dump_fd])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
