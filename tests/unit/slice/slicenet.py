"""A slice of workers on a real network stack: one network namespace per worker, joined by a bridge
in a hub namespace, each worker with its own metadata emulator and tpu-env, all on 127.0.0.0/8.

Why loopback addresses work between namespaces: every namespace has its own ``lo``, which by
default claims all of 127.0.0.0/8 as local (``local 127.0.0.0/8 dev lo`` in its local table), so
a connect to 127.10.0.2 would never leave it. Each worker's ``lo`` keeps 127.0.0.1/32 only (its
own metadata emulator listens there), its veth gets 127.10.0.N/24, and
``net.ipv4.conf.{all,eth0}.route_localnet=1`` lets the kernel route, and answer ARP for,
127/8 addresses on a non-loopback interface instead of dropping them as martians. Nothing here
touches the test host's own namespace: the bridge lives in the hub namespace.

Every namespace and process is the test's own, removed by :meth:`SliceNet.close` (a fixture's
teardown), even when the test fails. Needs root, ``ip`` (iproute2) and ``nft`` (nftables).
"""

from __future__ import annotations

import itertools
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from tpuboot.env.tpuenv import render_env_file

REPO = Path(__file__).resolve().parents[3]
PEER = Path(__file__).with_name("peer.py")
#: Bound on a child's first line ("listening"): start-up on a loaded 2-core machine.
START_TIMEOUT = 60.0
SUBNET = "127.10.0"
_COUNTER = itertools.count()

NEEDS = [name for name in ("ip", "nft") if shutil.which(name) is None]
AVAILABLE = os.geteuid() == 0 and not NEEDS
WHY_NOT = "needs root and ip, nft (scripts/host-packages.txt: iproute2, nftables)"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SliceNet:
    """``count`` workers; worker i is namespace ``names[i]`` at :meth:`address` ``(i)``."""

    def __init__(self, tmp: Path, count: int) -> None:
        self.tmp = tmp
        tag = f"tbs{os.getpid()}x{next(_COUNTER)}"
        self.hub = f"{tag}hub"
        self.names = [f"{tag}w{i}" for i in range(count)]
        self.processes: list[subprocess.Popen[str]] = []
        self.emulators: dict[int, str] = {}  # worker -> host:port of its metadata emulator
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for name in (self.hub, *self.names):
            ip("netns", "add", name)
            self._made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
            ip("-n", name, "addr", "del", "127.0.0.1/8", "dev", "lo")
            ip("-n", name, "addr", "add", "127.0.0.1/32", "dev", "lo")
            self.run(i, ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"])
            self.run(i, ["sysctl", "-qw", "net.ipv4.conf.eth0.route_localnet=1"])
            ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def endpoints(self, addresses: Sequence[str] | None = None) -> str:
        """``worker-network-endpoints`` as the TPU API writes it (NAME:ID:IP), for ``addresses``."""
        listed = addresses if addresses is not None else [self.address(i) for i in range(len(self.names))]
        return ",".join(f"t1v-n-{i}:{i}:{a}" for i, a in enumerate(listed))

    def _argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def run(self, i: int, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._argv(i, argv), check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def start(self, i: int, argv: Sequence[str]) -> subprocess.Popen[str]:
        """A child in worker i's namespace, once its first line is out (it is ready); that line in
        ``.ready``."""
        child = subprocess.Popen(
            self._argv(i, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env()
        )
        self.processes.append(child)
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], START_TIMEOUT)
        assert ready, f"{argv[:3]} said nothing in {START_TIMEOUT} s"
        line = child.stdout.readline()
        assert line, f"{argv} ended: {child.stderr.read() if child.stderr else ''}"
        child.ready = line.strip()  # type: ignore[attr-defined]
        return child

    def listen(self, i: int, *ports: int) -> subprocess.Popen[str]:
        """A peer on worker i that accepts on ``ports`` and never answers."""
        return self.start(i, [sys.executable, str(PEER), self.address(i), *map(str, ports)])

    def drop(self, i: int, port: int) -> None:
        """Worker i's firewall drops every TCP packet to ``port`` (nftables, in its namespace)."""
        rules = (
            "table inet slicetest {\n chain input {\n  type filter hook input priority 0; policy accept;\n"
            f"  tcp dport {port} drop\n }}\n}}\n"
        )
        self.run(i, ["nft", "-f", "-"], input=rules)

    def undrop(self, i: int) -> None:
        self.run(i, ["nft", "delete", "table", "inet", "slicetest"])

    def metadata(self, i: int, attributes: Mapping[str, str], instance: Mapping[str, str]) -> None:
        """Worker i's own metadata emulator (on its 127.0.0.1), serving its view of the slice."""
        files = []
        for kind, values in (("attributes", attributes), ("instance", instance)):
            path = self.tmp / f"w{i}-{kind}.yaml"
            path.write_text(yaml.safe_dump(dict(values)))
            files += [f"--{kind}", str(path)]
        child = self.start(i, [sys.executable, "-m", "harness.mds_emulator", *files])
        self.emulators[i] = child.ready.rsplit(" ", 1)[-1]  # type: ignore[attr-defined]

    def config(self, i: int, tpu_env: Mapping[str, str]) -> Path:
        """Worker i's tpuboot.yaml and tpu-env: its emulator, its tpu-env file."""
        env = self.tmp / f"w{i}-tpu-env"
        env.write_text(render_env_file(tpu_env))
        config = self.tmp / f"w{i}-tpuboot.yaml"
        config.write_text(
            yaml.safe_dump({"metadata": {"host": self.emulators[i]}, "env": {"tpu_env_path": str(env)}})
        )
        return config

    def env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("GCE_METADATA", "TPUBOOT_ROOT"))}
        return {**keep, "PYTHONPATH": str(REPO)}

    def tpuboot(self, i: int, *args: str) -> subprocess.CompletedProcess[str]:
        """``tpuboot ARGS`` on worker i with its config (never raises for its exit status)."""
        argv = [sys.executable, "-m", "tpuboot", "--config", str(self.tmp / f"w{i}-tpuboot.yaml"), *args]
        return subprocess.run(
            self._argv(i, argv), capture_output=True, text=True, env=self.env(), timeout=300
        )

    def tpuboot_started(self, i: int, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "tpuboot", "--config", str(self.tmp / f"w{i}-tpuboot.yaml"), *args]
        child = subprocess.Popen(
            self._argv(i, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env()
        )
        self.processes.append(child)
        return child

    def close(self) -> None:
        for child in self.processes:
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
