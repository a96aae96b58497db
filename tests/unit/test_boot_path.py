"""`tpuboot run`'s boot path (issue 32): until READY it imports only what READY waits for.

The daemon runs in a subprocess as systemd starts it (tests/unit/helpers/runproc.py), every part
on, with ``PYTHONPROFILEIMPORTTIME`` set: Python then writes a line to stderr as each module is
first imported, in the same stream, in order, as the daemon's ``ready:`` line, which it logs just
before READY=1 goes out. So the modules named above that line were imported before READY, those
below it after, with nothing in tpuboot or the test patched. The after-boot parts' modules (and
what only they bring: the supervision, the holders' scan, prometheus_client) must all be below it;
and a stop asked before READY ends the daemon without importing them at all.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from harness.mds_emulator import MetadataEmulator
from harness.polling import wait_until
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import add_tpu
from tests.unit.helpers.runproc import free_port, port_open, tpuboot_run

#: What READY waits for: the loop and the device manager, the CDI spec, tpu-env and the metadata client.
BOOT = ("tpuboot.daemon", "tpuboot.devices.manager", "tpuboot.containers.cdi_file", "tpuboot.env.service",
        "tpuboot.gce.client")  # fmt: skip
#: The after-boot parts' modules, and what only they bring.
AFTER_BOOT = (
    "tpuboot.containers.service",  # the containers...
    "tpuboot.containers.supervisor",
    "tpuboot.containers.docker",  # ... over Docker
    "tpuboot.containers.vbar_relay",
    "tpuboot.notices.service",
    "tpuboot.runtime.collector",
    "tpuboot.derived",  # the guest attributes, the TPU-VM gate, vBar's mark
    "tpuboot.gce.guestattrs",
    "tpuboot.devices.recovery",
    "tpuboot.holders.report",  # recovery's look at the holders
    "tpuboot.metrics_endpoint",
    "tpuboot.metrics_export",  # in the endpoint's thread, with prometheus_client
    "prometheus_client",
)
#: Every part on: vBar (and its relay: vbar.endpoint's default), the notices, the runtime collector,
#: the guest attributes and the tpu-env watch (their long-polls), recovery, the metrics endpoint.
CONFIG = """\
metrics: {{address: 127.0.0.1, port: {port}}}
metadata: {{boot_deadline: 20, watch: true}}
recovery: {{automatic: true}}
guest_attributes: {{enabled: "true"}}
"""
_IMPORTED = re.compile(r"import time:\s+\d+ \|\s+\d+ \| *(\S+)")
READY_LINE = "tpuboot: ready: "


def imports(stderr: str) -> tuple[list[str], list[str]]:
    """The modules first imported before the daemon's ``ready:`` line, and those after it."""
    before: list[str] = []
    after: list[str] = []
    side = before
    for line in stderr.splitlines():
        if line.startswith(READY_LINE):
            side = after
        elif found := _IMPORTED.match(line):
            side.append(found.group(1))
    return before, after


def a_tpu_vm(top: Path) -> FakeKernel:
    kernel = FakeKernel(top)
    add_tpu(kernel, driver="vfio-pci")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir(exist_ok=True)
    return kernel


def test_until_ready_only_the_boot_parts_are_imported_and_the_others_right_after(
    tmp_path: Path, emulator: MetadataEmulator
) -> None:
    kernel = a_tpu_vm(tmp_path / "root")
    port = free_port()
    stderr = tmp_path / "stderr"
    profile = {"PYTHONPROFILEIMPORTTIME": "1"}
    with tpuboot_run(kernel.top, CONFIG.format(port=port), emulator.host, tmp_path, env=profile,
                     stderr=stderr) as daemon:  # fmt: skip
        seen = daemon.receive("READY=1")
        # The endpoint opens last, in its thread, after the other after-boot parts were made.
        wait_until(lambda: port_open(port), timeout=60)
        daemon.process.send_signal(signal.SIGTERM)
        seen += daemon.receive("STOPPING=1", 20)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0 and READY_LINE in daemon.stderr
    before, after = imports(daemon.stderr)
    assert set(BOOT) <= set(before)
    assert [module for module in AFTER_BOOT if module in before] == []
    assert [module for module in AFTER_BOOT if module not in after] == []
    ready = next(message for message in seen if "READY=1" in message)
    assert "vBar" not in ready  # STATUS at READY: the boot parts only; the containers' line comes after
    assert any("STATUS=" in message and "vBar" in message for message in seen)


def test_a_stop_before_ready_never_imports_the_after_boot_parts(
    tmp_path: Path, emulator: MetadataEmulator
) -> None:
    """A metadata server that does not answer holds READY (the boot's tpu-env sync); SIGTERM then
    ends the daemon, which never made, started or stopped an after-boot part."""
    emulator.set_faults(delay=30.0)
    kernel = a_tpu_vm(tmp_path / "root")
    stderr = tmp_path / "stderr"
    profile = {"PYTHONPROFILEIMPORTTIME": "1"}
    config = CONFIG.format(port=free_port()).replace("boot_deadline: 20", "boot_deadline: 60")
    with tpuboot_run(kernel.top, config, emulator.host, tmp_path, env=profile, stderr=stderr) as daemon:
        wait_until(lambda: emulator.request_count >= 1, timeout=60)
        daemon.process.send_signal(signal.SIGTERM)
        seen = daemon.receive("STOPPING=1", 20)
        daemon.process.wait(timeout=20)
    assert daemon.process.returncode == 0
    assert not any("READY=1" in message for message in seen)
    before, after = imports(daemon.stderr)
    assert set(BOOT) <= set(before) and after == []
    assert [module for module in AFTER_BOOT if module in before] == []
    assert "Traceback" not in daemon.stderr
