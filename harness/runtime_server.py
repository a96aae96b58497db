"""A stand-in for libtpu's runtime metric service: a real gRPC server on 127.0.0.1, for tests,
benchmarks and VM guests.

It serves ``tpu.monitoring.runtime.RuntimeMetricService`` (ListSupportedMetrics,
GetRuntimeMetric) from a :class:`Fixture` written from the published interface
(tpu-info's ``tpu_info/proto/tpu_metric_service.proto``), encoded with tpuboot's own wire encoders,
and the fixture can change while it runs (a hang turning on). The misbehaving services a
collector must survive are here too: fixtures whose answers are garbage, too large, of the wrong
types or of unknown names; one that never answers and one that resets every connection are
:mod:`harness.listeners`.

Standalone (a VM guest's stand-in job)::

    python3 harness/runtime_server.py --port 8431 --devices 4 [--hold /dev/vfio/N]

serves until killed; SIGUSR1 turns the hang gauge on, SIGUSR2 off. ``--hold`` opens a chip's node
first and keeps it open, as a job's libtpu does: the stand-in job of a stand-in chip.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpuboot.runtime import wire
from tpuboot.runtime.reading import (
    DUTY_CYCLE,
    MEGASCALE_ERROR,
    MEMORY_TOTAL,
    MEMORY_USED,
    SLICE_ERROR,
)

SERVICE = "tpu.monitoring.runtime.RuntimeMetricService"
GIB = 1 << 30


@dataclass(frozen=True)
class Dev:
    """One device as the fixture serves it."""

    device: int
    duty: float
    used: int
    total: int


@dataclass(frozen=True)
class Fixture:
    """What the service answers. ``attribute``: how a device is named (``int`` as older libtpu,
    ``string`` as newer). ``answer``: ``normal``, ``garbage`` (bytes that are no message),
    ``huge`` (a message above the client's limit), ``wrong-types`` (strings where numbers go),
    ``unknown-names`` (a supported list of names tpuboot does not know, and answers under
    another name), ``abort`` (every call fails with UNAVAILABLE)."""

    devices: tuple[Dev, ...] = ()
    hang: bool = False
    slice_error: str | None = None
    attribute: str = "int"
    answer: str = "normal"
    extra_names: tuple[str, ...] = ()


def v5e(count: int = 4, duty: float = 37.5) -> Fixture:
    """``count`` single-device chips of 16 GiB."""
    return Fixture(tuple(Dev(i, duty + i, (i + 1) * GIB, 16 * GIB) for i in range(count)))


def tpu7x(chips: int = 2) -> Fixture:
    """TPU7x: two devices per chip, each with its own HBM, named by string digits (newer libtpu)."""
    devices = tuple(Dev(i, 50.0, 8 * GIB + i, 96 * GIB) for i in range(chips * 2))
    return Fixture(devices, attribute="string")


def _attr_value(value: Any) -> bytes:
    if isinstance(value, bool):
        return wire.int_field(2, int(value))
    if isinstance(value, int):
        return wire.int_field(3, value)
    if isinstance(value, float):
        return wire.double_field(4, value)
    if isinstance(value, dict):
        pairs = b"".join(wire.bytes_field(1, _attribute(k, v)) for k, v in value.items())
        return wire.bytes_field(6, pairs)
    return wire.string_field(1, str(value))


def _attribute(key: str, value: Any) -> bytes:
    return wire.string_field(1, key) + wire.bytes_field(2, _attr_value(value))


def _gauge(value: Any) -> bytes:
    if isinstance(value, float):
        return wire.double_field(1, value)
    if isinstance(value, int):
        return wire.int_field(2, value)
    return wire.string_field(3, str(value))


def _metric(key: str, attribute: Any, gauge: Any) -> bytes:
    return wire.bytes_field(1, _attribute(key, attribute)) + wire.bytes_field(3, _gauge(gauge))


def encode_response(name: str, samples: list[bytes]) -> bytes:
    body = (
        wire.string_field(1, name)
        + wire.string_field(2, "stand-in")
        + b"".join(wire.bytes_field(3, s) for s in samples)
    )
    return wire.bytes_field(1, body)


def answer(fixture: Fixture, name: str) -> bytes:
    """GetRuntimeMetric's answer for ``name`` under ``fixture``."""
    if fixture.answer == "garbage":
        return b"\x0a\xff\xff\xff\x7f not a message"
    if fixture.answer == "huge":
        return wire.bytes_field(1, wire.string_field(2, "x" * (2 << 20)))
    wrong = fixture.answer == "wrong-types"
    served = name + ".renamed" if fixture.answer == "unknown-names" else name

    def dev(d: Dev) -> Any:
        return str(d.device) if fixture.attribute == "string" else d.device

    samples: list[bytes] = []
    for d in fixture.devices:
        if name == DUTY_CYCLE:
            samples.append(_metric("device-id", dev(d), "busy" if wrong else d.duty))
        elif name == MEMORY_USED:
            samples.append(_metric("device-id", 1.5 if wrong else dev(d), d.used))
        elif name == MEMORY_TOTAL:
            samples.append(_metric("device-id", dev(d), d.total))
    if name == MEGASCALE_ERROR:
        samples.append(_metric("", {"error_type": "HANG_DETECTED"}, int(fixture.hang)))
    if name == SLICE_ERROR:
        attrs = {
            "error_message": fixture.slice_error or "",
            "session_id": "s1",
            "type": "t",
            "topology": "2x2",
        }
        samples.append(_metric("", attrs, int(fixture.slice_error is not None)))
    return encode_response(served, samples)


def supported(fixture: Fixture) -> bytes:
    names = [DUTY_CYCLE, MEMORY_USED, MEMORY_TOTAL, MEGASCALE_ERROR, SLICE_ERROR, *fixture.extra_names]
    if fixture.answer == "unknown-names":
        names = ["tpu.runtime.something.new", *names]
    return b"".join(wire.bytes_field(1, wire.string_field(1, n)) for n in names)


def _request_name(request: bytes) -> str:
    for number, _, value in wire.fields(request):
        if number == 1 and isinstance(value, bytes):
            return value.decode("utf-8", "replace")
    return ""


@dataclass
class RuntimeServer:
    """The service on ``127.0.0.1:port`` (0: a free one) serving :attr:`fixture`, which a test
    may replace at any time; :attr:`calls` counts the calls by method."""

    fixture: Fixture = field(default_factory=v5e)
    port: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import grpc

        self._grpc = grpc
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        handlers = {
            "ListSupportedMetrics": grpc.unary_unary_rpc_method_handler(self._list),
            "GetRuntimeMetric": grpc.unary_unary_rpc_method_handler(self._get),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._lock = threading.Lock()

    def _count(self, method: str, context: Any) -> Fixture:
        with self._lock:
            self.calls[method] = self.calls.get(method, 0) + 1
        fixture = self.fixture
        if fixture.answer == "abort":
            context.abort(self._grpc.StatusCode.UNAVAILABLE, "libtpu is shutting down")
        return fixture

    def _list(self, request: bytes, context: Any) -> bytes:
        return supported(self._count("ListSupportedMetrics", context))

    def _get(self, request: bytes, context: Any) -> bytes:
        return answer(self._count("GetRuntimeMetric", context), _request_name(request))

    def set(self, **changes: Any) -> None:
        self.fixture = replace(self.fixture, **changes)

    def start(self) -> RuntimeServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(None).wait()

    def __enter__(self) -> RuntimeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--hold", help="a device node to keep open while serving")
    args = parser.parse_args()
    held = os.open(args.hold, os.O_RDWR) if args.hold else None  # kept open until killed
    server = RuntimeServer(v5e(args.devices), port=args.port).start()
    signal.signal(signal.SIGUSR1, lambda *_: server.set(hang=True))
    signal.signal(signal.SIGUSR2, lambda *_: server.set(hang=False))
    print(
        f"serving on 127.0.0.1:{server.port}" + (f", holding {args.hold}" if held is not None else ""),
        flush=True,
    )
    while True:
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main())
