"""Calls to libtpu's RuntimeMetricService on one loopback port, each with a deadline.

gRPC (python3-grpcio, an optional dependency: :func:`grpc_missing`) carries the calls; the
messages are tpuboot's own bytes (:mod:`tpuboot.runtime.wire`), passed through grpcio's generic
unary calls untouched, so no generated code is needed. A channel lives for one poll and is closed
after it (as GKE's device plugin dials per poll): a libtpu that restarted, or a port now another
process's, is met afresh, and nothing of gRPC stays between polls.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tpuboot.errors import TpubootError, printable
from tpuboot.runtime import wire

SERVICE = "/tpu.monitoring.runtime.RuntimeMetricService/"
LIST = SERVICE + "ListSupportedMetrics"
GET = SERVICE + "GetRuntimeMetric"
#: The largest answer taken: a host's few devices need a few KiB; more is not libtpu's.
MAX_MESSAGE = 1 << 20
#: Each call's deadline (GKE's device plugin gives a whole poll one second).
CALL_TIMEOUT = 1.0
#: The only address polled: libtpu's metric service of a job on this host.
LOOPBACK = "127.0.0.1"
GRPC_PACKAGE = "python3-grpcio"


class CallError(TpubootError):
    """A call that failed, in one line: the port, the method and gRPC's status or the decoding.
    ``kind`` is the method and status alone: gRPC's details of one trouble differ from call to
    call (a reset reads "recvmsg" once, "getsockopt" the next), and the journal says a trouble once."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def grpc_missing() -> str | None:
    """Why the runtime metrics are off for want of gRPC, in one line; None when grpcio is there."""
    if importlib.util.find_spec("grpc") is None:
        return (
            f"{GRPC_PACKAGE} is not installed: libtpu's runtime metrics are off (apt install {GRPC_PACKAGE})"
        )
    return None


class Client:
    """One port's service for one poll (:func:`connect`)."""

    def __init__(self, channel: Any, port: int, timeout: float) -> None:
        self.port = port
        self.timeout = timeout
        self._list = channel.unary_unary(LIST)  # no (de)serializers: bytes in, bytes out
        self._get = channel.unary_unary(GET)

    def _call(self, method: Any, name: str, request: bytes) -> bytes:
        import grpc

        try:
            answer = method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            said = exc.details() if hasattr(exc, "details") else str(exc)
            word = code.name if code is not None else "failed"
            message = f"port {self.port}: {name}: {word}: {printable(str(said or ''))[:160]}"
            raise CallError(message, f"{name} {word}") from None
        if not isinstance(answer, bytes):
            message = f"port {self.port}: {name}: gRPC returned {type(answer).__name__}, not bytes"
            raise CallError(message, f"{name} not bytes")
        return answer

    def supported(self) -> list[str]:
        data = self._call(self._list, "ListSupportedMetrics", wire.LIST_REQUEST)
        try:
            return wire.supported_metrics(data)
        except wire.DecodeError as exc:
            raise CallError(
                f"port {self.port}: ListSupportedMetrics: {exc}", "ListSupportedMetrics malformed"
            ) from None

    def metric(self, name: str) -> wire.Response:
        data = self._call(self._get, "GetRuntimeMetric", wire.metric_request(name))
        try:
            return wire.metric_response(data)
        except wire.DecodeError as exc:
            raise CallError(
                f"port {self.port}: GetRuntimeMetric {name}: {exc}", f"{name} malformed"
            ) from None


@contextmanager
def connect(port: int, timeout: float = CALL_TIMEOUT) -> Iterator[Client]:
    """A client of ``127.0.0.1:port``, its channel closed on leaving. Plain text on loopback, as
    GKE's device plugin speaks to libtpu; answers above :data:`MAX_MESSAGE` are refused."""
    import grpc

    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.enable_retries", 0),
        ("grpc.enable_http_proxy", 0),  # loopback only: never through a proxy of the environment
    ]
    channel = grpc.insecure_channel(f"{LOOPBACK}:{port}", options=options)
    try:
        yield Client(channel, port, timeout)
    finally:
        channel.close()
