"""Which loopback ports libtpu serves its metrics on: ``TPU_RUNTIME_METRICS_PORTS`` of tpu-env.

GKE and the DRA driver give a job one port per device from 8431 (a TPU7x chip is two devices);
a VM's tpu-env may leave the key out, and then libtpu's default, 8431 and up, one per device, is
polled. A value that is not a comma-separated list of ports is said once by the caller, and the
default is polled instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from tpuboot.env.tpuenv import env_value
from tpuboot.errors import shown

FIRST_PORT = 8431
KEY = "RUNTIME_METRICS_PORTS"  # env_value looks for TPU_RUNTIME_METRICS_PORTS too
#: More ports than a host has devices is not a port list (8 chips of two devices each is 16).
MAX_PORTS = 64


def default_ports(devices: int) -> tuple[int, ...]:
    return tuple(range(FIRST_PORT, FIRST_PORT + max(1, min(devices, MAX_PORTS))))


def parse_ports(text: str) -> tuple[int, ...]:
    """``8431,8432``: the ports, in order, once each; ValueError with the reason otherwise."""
    ports: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not (part.isascii() and part.isdigit()) or not 0 < int(part) < 65536:
            raise ValueError(f"{shown(part)} is not a TCP port")
        if int(part) not in ports:
            ports.append(int(part))
    if len(ports) > MAX_PORTS:
        raise ValueError(f"{len(ports)} ports, more than a host has devices ({MAX_PORTS})")
    return tuple(ports)


def runtime_ports(env: Mapping[str, str] | None, devices: int) -> tuple[tuple[int, ...], str | None]:
    """The ports to poll from tpu-env's values (None: no tpu-env), and why the value was not used
    when it was garbage (one line, for the journal)."""
    text = None if env is None else env_value(env, KEY)
    if text is None:
        return default_ports(devices), None
    try:
        return parse_ports(text), None
    except ValueError as exc:
        return default_ports(devices), (
            f"tpu-env's TPU_{KEY} {shown(text)}: {exc}; polling {FIRST_PORT} and up instead"
        )
