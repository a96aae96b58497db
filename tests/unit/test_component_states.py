"""Each component's states are one Literal alias in its module (tpuboot/component.py says which),
and the constants the daemon compares a Status.state with are among them."""

from __future__ import annotations

from typing import get_args

from tpuboot.containers import service as containers
from tpuboot.containers import supervisor
from tpuboot.devices import manager
from tpuboot.env import results
from tpuboot.env import service as env
from tpuboot.gce import guestattrs


def values(alias: object) -> set[str]:
    """A Literal's strings, nested Literals flattened (as typing does on 3.10 and later)."""
    return set(get_args(alias))


def test_the_aliases_hold_the_states_and_their_constants() -> None:
    assert values(manager.ManagerState) == {"bound", "binding", "failed", "none"}
    assert values(env.EnvState) == values(results.Source) | {env.PENDING}
    assert set(env.HELD) <= values(results.Source)
    states = {"STARTING", "RUNNING", "WAITING", "REFUSED", "FAILED", "RESTARTING"}
    assert {getattr(supervisor, name) for name in states} == values(supervisor.SupervisedState)
    assert values(containers.ContainerState) == values(supervisor.SupervisedState) | {containers.NOT_STARTED}
    publisher = {guestattrs.CHECKING, guestattrs.PUBLISHING, guestattrs.OFF}
    assert publisher == values(guestattrs.PublisherState)


def test_the_device_manager_says_each_of_its_states(tmp_path) -> None:
    from tests.unit.fakes.kernel import FakeKernel
    from tests.unit.helpers.devices import binder
    from tpuboot.eventloop import EventLoop

    kernel = FakeKernel(tmp_path)
    loop = EventLoop()
    devices = manager.DeviceManager(loop, binder(kernel), None, None, None)  # type: ignore[arg-type]
    seen = {devices.status().state}
    for state in ("pending", "failed", "bound"):
        devices.devices["0000:00:04.0"] = manager.DeviceState("v5p", state)
        seen.add(devices.status().state)
    loop.close()
    assert seen == values(manager.ManagerState)
