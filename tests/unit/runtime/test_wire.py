"""The hand encoding against the published interface: round trips through the stand-in's encoder,
and each malformed message refused with one line, never an exception of another kind."""

from __future__ import annotations

import pytest

from harness.runtime_server import answer, encode_response, supported, tpu7x, v5e
from tpuboot.runtime import wire
from tpuboot.runtime.reading import DUTY_CYCLE, MEMORY_TOTAL, WANTED, device_of


def test_varints_and_negative_int64() -> None:
    for value in (0, 1, 127, 128, 300, 1 << 35, (1 << 63) - 1, -1, -(1 << 63)):
        data = wire.int_field(3, value)
        ((number, wire_type, raw),) = wire.fields(data)
        assert (number, wire_type) == (3, wire.VARINT)
        signed = raw - (1 << 64) if raw >= 1 << 63 else raw
        assert signed == value
    assert len(wire.varint(-1)) == 10


def test_supported_metrics_round_trip() -> None:
    assert wire.supported_metrics(supported(v5e())) == list(WANTED)


def test_metric_response_round_trip_int_and_string_devices() -> None:
    old = wire.metric_response(answer(v5e(2), DUTY_CYCLE))
    assert old.name == DUTY_CYCLE
    assert [(device_of(s), s.gauge) for s in old.samples] == [("0", 37.5), ("1", 38.5)]
    new = wire.metric_response(answer(tpu7x(1), MEMORY_TOTAL))
    assert [(s.attribute, s.gauge) for s in new.samples] == [("0", 96 << 30), ("1", 96 << 30)]


def test_unknown_fields_are_skipped() -> None:
    extra = wire.int_field(15, 7) + wire.double_field(14, 1.0) + wire.tag(13, wire.FIXED32) + b"\0\0\0\0"
    data = encode_response("x", []) + extra
    assert wire.metric_response(data).name == "x"


@pytest.mark.parametrize(
    "data, said",
    [
        (b"\x0a\xff\xff\xff\x7f", "more than the message has left"),
        (b"\x80", "past the end"),
        (b"\xff" * 11, "longer than 10 bytes"),
        (b"\x0b", "wire type 3"),
        (b"\x00\x01", "field number 0"),
        (wire.int_field(1, 5), "wire type 0, not 2"),
        (wire.bytes_field(1, wire.bytes_field(1, b"\xff\xfe")), "not UTF-8"),
    ],
)
def test_malformed_messages_are_one_line(data: bytes, said: str) -> None:
    with pytest.raises(wire.DecodeError, match=said):
        wire.metric_response(data)


def test_nesting_is_bounded() -> None:
    value = wire.string_field(1, "x")
    for _ in range(wire.MAX_DEPTH + 2):
        value = wire.bytes_field(5, wire.bytes_field(1, value))
    metric = wire.bytes_field(1, wire.string_field(1, "k") + wire.bytes_field(2, value))
    with pytest.raises(wire.DecodeError, match="nested deeper"):
        wire.metric_response(wire.bytes_field(1, wire.bytes_field(3, metric)))
