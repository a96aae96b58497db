"""Every OSError of every bind step is that device's failure: one line, transient by errno, contained.

A table of errnos is injected at each step (tests/unit/fakes/kernel.Faults); the same faults then
go through the daemon's coldplug and event paths and the CLI, which must each survive them.
"""

from __future__ import annotations

import errno
import logging

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import make, on_loop, serving, until
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tpuboot import cli
from tpuboot.daemon import Daemon
from tpuboot.devices import manager
from tpuboot.errors import DeviceError, TpubootError

DBDF = "0000:00:04.0"

# What the kernel or the device can clear by itself (retried), and what needs the admin (not).
TRANSIENT = [errno.EBUSY, errno.EAGAIN, errno.EINTR, errno.EIO, errno.ENODEV, errno.ENXIO, errno.ENOMEM,
             errno.ETIMEDOUT]  # fmt: skip
PERMANENT = [errno.EPERM, errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EINVAL, errno.EXDEV]

# (what the step is, the access, the path it touches): every sysfs or /dev access of a bind.
STEPS = [
    ("device directory", "stat", f"devices/{DBDF}"),
    ("uevent read", "open", f"{DBDF}/uevent"),
    ("iommu_group link read", "readlink", f"{DBDF}/iommu_group"),
    ("vfio-pci driver lookup", "stat", "drivers/vfio-pci"),
    ("driver_override read", "open", f"{DBDF}/driver_override"),
    ("driver_override write", "write", f"{DBDF}/driver_override"),
    ("driver link read", "readlink", f"{DBDF}/driver"),
    ("unbind write", "write", "driver/unbind"),
    ("drivers_probe write", "write", "drivers_probe"),
    ("group members listing", "listdir", "iommu_groups/4/devices"),
    ("allow_unsafe_interrupts lookup", "stat", "allow_unsafe_interrupts"),
    ("allow_unsafe_interrupts read", "open", "allow_unsafe_interrupts"),
    ("allow_unsafe_interrupts write", "write", "allow_unsafe_interrupts"),
    ("node stat", "stat", "/dev/vfio/4"),
    ("udev control lookup", "stat", "/run/udev/control"),
    ("node chmod", "chmod", "/dev/vfio/4"),
]


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    k = FakeKernel(tmp_path, "builtin")
    k.faults.install(monkeypatch)
    return k


def expected_transient(step: str, code: int) -> bool:
    if step == "drivers_probe write":  # a probe error other than a refusal: the link decides, and
        return code not in (errno.EPERM, errno.EACCES, errno.EROFS)  # "did not take" is retried
    return code in TRANSIENT


@pytest.mark.parametrize("code", TRANSIENT + PERMANENT, ids=errno.errorcode.get)
@pytest.mark.parametrize(("step", "op", "suffix"), STEPS, ids=[s[0] for s in STEPS])
def test_an_errno_at_any_bind_step_is_a_one_line_device_error(kernel, step, op, suffix, code):
    add_tpu(kernel, DBDF, V5P, driver="virtio-pci", group="4")
    kernel.faults.add(op, suffix, code)  # type: ignore[arg-type]
    b = binder(kernel)
    with pytest.raises(DeviceError) as caught:
        b.bind(DBDF)
    assert kernel.faults.hits, f"{step}: the fault was never reached"
    message = str(caught.value)
    assert message.startswith(DBDF) and "\n" not in message
    assert errno.errorcode[code] in message
    assert caught.value.transient is expected_transient(step, code), message
    kernel.faults.clear()  # the cause goes away: the next bind succeeds from whatever state was left
    assert b.bind(DBDF).node == "/dev/vfio/4"
    assert kernel.driver(DBDF) == "vfio-pci"


@pytest.mark.parametrize("code", [errno.EPERM, errno.EIO, errno.EBUSY])
@pytest.mark.parametrize(
    ("op", "suffix"), [("write", "driver_override"), ("write", "unbind"), ("readlink", f"{DBDF}/driver")]
)
def test_unbind_turns_every_errno_into_a_device_error(kernel, op, suffix, code):
    add_tpu(kernel, DBDF, V5P, driver="virtio-pci", group="4")
    b = binder(kernel)
    b.bind(DBDF)
    kernel.faults.add(op, suffix, code)
    with pytest.raises(DeviceError, match=rf"^{DBDF}: .*{errno.errorcode[code]}"):
        b.unbind(DBDF)


def test_a_node_gone_between_stat_and_chmod_is_retried(kernel):
    add_tpu(kernel, DBDF, V5P, group="4")
    kernel.faults.add("chmod", "/dev/vfio/4", errno.ENOENT)
    with pytest.raises(DeviceError, match="ENOENT") as caught:
        binder(kernel).bind(DBDF)
    assert caught.value.transient


def test_a_device_removed_during_bind_says_so(kernel, monkeypatch):
    add_tpu(kernel, DBDF, V5P, group="4")
    b = binder(kernel)
    real = b.write

    def unplug_then_write(path, value):
        kernel.remove_device(DBDF)
        real(path, value)

    b.write = unplug_then_write
    with pytest.raises(DeviceError, match=rf"^{DBDF}: "):
        b.bind(DBDF)


# --- the daemon: coldplug and events survive any device's failure ------------------------------


@pytest.fixture
def four(kernel):
    for i in range(4):
        add_tpu(kernel, f"0000:00:0{4 + i}.0", V5P, driver=None, group=str(4 + i))
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    return kernel


def run_daemon(kernel: FakeKernel, check, *, b=None) -> Daemon:
    """Run the daemon as `tpuboot run` does (coldplug's binds submitted before the loop); ``check``
    runs in the test's thread once it is READY, and the daemon must still be serving after it."""
    daemon, _, _ = make(kernel, b=b or binder(kernel))
    with serving(daemon) as running:
        until(lambda: daemon.ready or running.ended)
        assert not running.ended, running.error
        check(daemon)
        assert not running.ended, running.error
        assert running.stop() == 0
    return daemon


def test_a_refused_chmod_at_coldplug_fails_that_device_only(four, caplog):
    """Before: PermissionError escaped the bind's task and ended the daemon before READY."""
    four.faults.add("chmod", "/dev/vfio/5", errno.EPERM)

    def check(daemon):
        status = daemon.notifier.last_status
        assert status.startswith("3 of 4 TPUs bound to vfio-pci; 0000:00:05.0: setting /dev/vfio/5 to mode")
        assert "EPERM" in status and "an LSM (AppArmor, SELinux) denied it" in status
        assert daemon.devices.devices["0000:00:05.0"].retry is None  # permanent: not retried

    with caplog.at_level(logging.INFO, logger="tpuboot"):
        run_daemon(four, check)
    (record,) = [
        r for r in caplog.records if "EPERM" in r.getMessage() and r.name == "tpuboot.devices.manager"
    ]
    assert record.levelname == "ERROR" and record.DBDF == "0000:00:05.0"  # type: ignore[attr-defined]
    assert [four.driver(f"0000:00:0{4 + i}.0") for i in (0, 2, 3)] == ["vfio-pci"] * 3


@pytest.mark.parametrize(
    ("op", "suffix"),
    [("write", "0000:00:05.0/driver_override"), ("open", "0000:00:05.0/driver_override"),
     ("chmod", "/dev/vfio/5"), ("open", "0000:00:05.0/uevent")],
)  # fmt: skip
def test_a_transient_errno_is_retried_until_bound(four, monkeypatch, op, suffix):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 0.01)
    four.faults.add(op, suffix, errno.EIO, times=2)

    def check(daemon):
        until(lambda: daemon.notifier.last_status == "4 TPUs bound to vfio-pci")

    run_daemon(four, check)
    assert len(four.faults.hits) == 2


def test_unreadable_ids_at_an_event_are_shown_and_retried_and_a_non_tpu_is_then_dropped(four, monkeypatch):
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 0.01)

    def check(daemon):
        four.add_device("0000:00:0b.0", 0x1AF4, 0x1000, driver="virtio-pci", group="11")
        four.faults.add("open", "0000:00:0b.0/uevent", errno.EIO, times=1)
        four.faults.add("open", "0000:00:0c.0/uevent", errno.EACCES)
        add_tpu(four, "0000:00:0c.0", V5P, group="12")
        daemon.devices.monitor.push("add", "pci", "0000:00:0b.0")
        daemon.devices.monitor.push("add", "pci", "0000:00:0c.0")
        until(lambda: "0000:00:0c.0" in daemon.devices.devices)
        until(lambda: "0000:00:0b.0" not in daemon.devices.devices)  # retried: not a TPU
        status = daemon.notifier.last_status
        assert status.startswith("4 TPUs bound to vfio-pci; 0000:00:0c.0: reading its PCI ids failed (EACCES")
        four.faults.clear()
        daemon.devices.monitor.push("add", "pci", "0000:00:0c.0")  # a new event after the fix: bound
        until(lambda: daemon.notifier.last_status == "5 TPUs bound to vfio-pci")

    run_daemon(four, check)


def test_an_unexpected_exception_is_logged_once_and_fails_that_device(four, caplog):
    b = binder(four)
    bind = b.bind

    def buggy(address: str, **kwargs: object):
        if address == "0000:00:06.0":
            raise KeyError("bug")
        return bind(address, **kwargs)

    b.bind = buggy  # type: ignore[method-assign]

    def check(daemon):
        assert daemon.notifier.last_status.startswith(
            "3 of 4 TPUs bound to vfio-pci; 0000:00:06.0: unexpected KeyError in bind"
        )
        daemon.devices.monitor.push("add", "pci", "0000:00:06.0")  # the loop still answers events
        until(lambda: daemon.devices.devices["0000:00:06.0"].attempts == 1 and
                    not daemon.devices.devices["0000:00:06.0"].running and
                    len([r for r in caplog.records if "unexpected" in r.getMessage()]) >= 2)  # fmt: skip
        add_tpu(four, "0000:00:0a.0", V5P, group="10")
        daemon.devices.monitor.push("add", "pci", "0000:00:0a.0")
        until(lambda: four.driver("0000:00:0a.0") == "vfio-pci")

    with caplog.at_level(logging.INFO, logger="tpuboot"):
        run_daemon(four, check, b=b)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and tracebacks[0].DBDF == "0000:00:06.0"  # type: ignore[attr-defined]


def test_a_broken_node_event_does_not_end_the_loop(four):
    def check(daemon):
        four.faults.add("stat", "/dev/vfio/4", errno.EACCES)
        daemon.devices.monitor.push("add", "vfio", "4")
        add_tpu(four, "0000:00:0a.0", V5P, group="10")
        daemon.devices.monitor.push("add", "pci", "0000:00:0a.0")
        until(lambda: four.driver("0000:00:0a.0") == "vfio-pci")

    run_daemon(four, check)


def test_backoff_of_a_long_series_does_not_overflow(four, monkeypatch):
    """retries is bounded at load, but the delay must not raise OverflowError for any attempt."""
    monkeypatch.setattr(manager, "BACKOFF_FIRST", 0.01)
    four.faults.add("open", "0000:00:05.0/uevent", errno.EIO)

    def on_the_loop(daemon):  # the device state is the loop's
        state = daemon.devices.devices["0000:00:05.0"]
        state.attempts = 5000
        daemon.devices._failed("0000:00:05.0", state, DeviceError("x"), {})  # permanent: no delay
        err = TpubootError("x")
        err.transient = True
        daemon.devices.binder.config = daemon.devices.binder.config.replace(retries=10_000)
        daemon.devices._failed("0000:00:05.0", state, err, {})
        assert state.retry is not None
        state.retry.cancel()

    def check(daemon):
        on_loop(daemon, lambda: on_the_loop(daemon))

    run_daemon(four, check)


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_bind_fails_one_device_in_one_line_and_binds_the_rest(tmp_path, monkeypatch, capsys):
    """Before: PermissionError from chmod ended `tpuboot bind` with a traceback."""
    kernel = FakeKernel(tmp_path / "root", "builtin")
    kernel.faults.install(monkeypatch)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    add_tpu(kernel, "0000:00:05.0", V5P, driver="vfio-pci", group="5")
    kernel.faults.add("chmod", "/dev/vfio/4", errno.EPERM)
    assert cli.main(["--root", str(kernel.top), "bind", "00:04.0", "00:05.0"]) == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    failures = [line for line in err.splitlines() if "0000:00:04.0" in line]
    assert "Traceback" not in err and len(failures) == 1
    assert failures[0].startswith("tpuboot: 0000:00:04.0: setting /dev/vfio/4 to mode 0666 failed (EPERM")
    assert out.startswith("0000:00:05.0 (TPU v5p) already bound to vfio-pci, /dev/vfio/5 mode 0666")
