"""`tpuboot run` as systemd starts it, end to end in a subprocess with the libraries of the run (the
library matrix runs it with each row's): config read with PyYAML, the udev monitor opened with
pyudev, tpu-env fetched with requests/urllib3, metrics served with prometheus_client, READY and
STOPPING sent with python-systemd. Every boot takes this path; with Ubuntu 22.04's
prometheus_client it once ended at the metrics import, before READY.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.mds_emulator import SAMPLE_TPU_ENV, MetadataEmulator
from tests.unit.fakekernel import FakeKernel
from tpuboot.tpuenv import render_env_file

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0  # imports and the first metadata fetch on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receive(sock: socket.socket, wanted: str, daemon: subprocess.Popen[str], within: float) -> list[str]:
    """Notifications until one holding ``wanted``; fails when the daemon exits or time runs out."""
    deadline = time.monotonic() + within
    sock.settimeout(0.2)
    seen: list[str] = []
    while not any(wanted in message for message in seen):
        try:
            seen.append(sock.recv(4096).decode())
            continue
        except TimeoutError:
            pass
        if daemon.poll() is not None and "STOPPING" not in wanted:
            raise AssertionError(f"tpuboot run exited ({daemon.returncode}) before {wanted!r}: {seen}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {wanted!r} from tpuboot run within {within:.0f} s; got {seen}")
    return seen


def test_run_starts_reports_ready_serves_metrics_and_stops_on_sigterm(
    tmp_path: Path, emulator: MetadataEmulator
) -> None:
    kernel = FakeKernel(tmp_path / "root")
    kernel.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    (kernel.top / "home" / "tpu-runtime").mkdir(parents=True)
    (kernel.top / "etc").mkdir()
    port = free_port()
    (kernel.top / "tpuboot.yaml").write_text(
        f"vbar: {{enabled: false}}\nmetrics: {{address: 127.0.0.1, port: {port}}}\n"
        "metadata: {boot_deadline: 20, watch: false}\n"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "notify"))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "NOTIFY_SOCKET": str(tmp_path / "notify"),
            "GCE_METADATA_HOST": emulator.host,
        }
        command = [
            sys.executable,
            "-m",
            "tpuboot",
            "--root",
            str(kernel.top),
            "--config",
            "/tpuboot.yaml",
            "run",
        ]
        daemon = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
        try:
            seen = receive(notify, "READY=1", daemon, START_TIMEOUT)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                scraped = response.read().decode()
            daemon.send_signal(signal.SIGTERM)
            seen += receive(notify, "STOPPING=1", daemon, 20)
            daemon.wait(timeout=20)
        finally:
            if daemon.poll() is None:
                daemon.kill()
            stderr = daemon.communicate(timeout=10)[1]
            print(f"tpuboot run's stderr:\n{stderr}", file=sys.stderr)  # pytest shows it on failure
    assert daemon.returncode == 0
    ready = next(message for message in seen if "READY=1" in message)
    assert "tpu-env: 14 keys from metadata" in ready, ready
    assert 'tpuboot_metadata_requests_total{outcome="ok"}' in scraped
    assert (kernel.top / "home/tpu-runtime/tpu-env").read_text() == render_env_file(SAMPLE_TPU_ENV)
    assert "Traceback" not in stderr, stderr
