"""The protocol-buffer wire format of the few messages libtpu's metric service speaks, by hand.

No generated code and no protobuf runtime: jammy's python3-protobuf (3.12) cannot load what a
newer protoc writes, and trixie's cannot load what an old one wrote; the wire format itself has
not changed since proto2 (doc/runtime-metrics.md). Only what tpuboot reads is decoded; unknown
fields are skipped, as every protobuf reader does. Every length is checked against what is left,
nesting is bounded, and anything else is a :class:`DecodeError` with one line saying where.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from tpuboot.errors import TpubootError

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
#: Deeper attribute values than this (lists of lists of ...) are not libtpu's.
MAX_DEPTH = 8
_DOUBLE = struct.Struct("<d")

#: An attribute's value as decoded: a key-value list becomes a dict, an array a tuple.
Value = str | int | float | bool | bytes | dict[str, "Value"] | tuple["Value", ...] | None


class DecodeError(TpubootError):
    """A message that is not what the service's interface says."""


# --- encoding -----------------------------------------------------------------------------------


def varint(value: int) -> bytes:
    """``value`` as a varint; a negative int64 as its 10-byte two's complement, as protobuf does."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def int_field(field: int, value: int) -> bytes:
    return tag(field, VARINT) + varint(value)


def double_field(field: int, value: float) -> bytes:
    return tag(field, FIXED64) + _DOUBLE.pack(value)


def bytes_field(field: int, value: bytes) -> bytes:
    return tag(field, LENGTH) + varint(len(value)) + value


def string_field(field: int, value: str) -> bytes:
    return bytes_field(field, value.encode("utf-8"))


def metric_request(name: str) -> bytes:
    """``MetricRequest{metric_name}``: node aggregation left on (libtpu's default)."""
    return string_field(1, name)


#: ``ListSupportedMetricsRequest{}``: no filter, every metric.
LIST_REQUEST = b""


# --- decoding -----------------------------------------------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise DecodeError("a varint runs past the end of the message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift >= 70:
            raise DecodeError("a varint longer than 10 bytes")


Field = tuple[int, int, int | bytes]


def fields(data: bytes) -> list[Field]:
    """Each (field number, wire type, value) of one message in order: an int for a varint or a
    fixed field (its raw bits), bytes for a length-delimited one. Groups are refused."""
    found: list[Field] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire_type == VARINT:
            value, at = _varint(data, at)
            found.append((number, wire_type, value))
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if at + size > len(data):
                raise DecodeError(f"field {number} runs past the end of the message")
            found.append((number, wire_type, int.from_bytes(data[at : at + size], "little")))
            at += size
        elif wire_type == LENGTH:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise DecodeError(f"field {number} is {size} bytes, more than the message has left")
            found.append((number, wire_type, bytes(data[at : at + size])))
            at += size
        else:
            raise DecodeError(f"field {number} has wire type {wire_type} (groups are not this service's)")
    return found


def _want(number: int, wire_type: int, value: int | bytes, wanted: int) -> None:
    if wire_type != wanted:
        raise DecodeError(f"field {number} has wire type {wire_type}, not {wanted}")


def _bytes(number: int, wire_type: int, value: int | bytes) -> bytes:
    _want(number, wire_type, value, LENGTH)
    assert isinstance(value, bytes)
    return value


def _text(number: int, wire_type: int, value: int | bytes) -> str:
    try:
        return _bytes(number, wire_type, value).decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"field {number} is not UTF-8 text") from None


def _int(number: int, wire_type: int, value: int | bytes, *, signed: bool = True) -> int:
    _want(number, wire_type, value, VARINT)
    assert isinstance(value, int)
    value &= (1 << 64) - 1
    return value - (1 << 64) if signed and value >= 1 << 63 else value


def _double(number: int, wire_type: int, value: int | bytes) -> float:
    _want(number, wire_type, value, FIXED64)
    assert isinstance(value, int)
    result: float = _DOUBLE.unpack(value.to_bytes(8, "little"))[0]
    return result


def supported_metrics(data: bytes) -> list[str]:
    """``ListSupportedMetricsResponse``: the metric names."""
    names = []
    for number, wire_type, value in fields(data):
        if number == 1:
            for inner in fields(_bytes(number, wire_type, value)):
                if inner[0] == 1:
                    names.append(_text(*inner))
    return names


@dataclass(frozen=True)
class Sample:
    """One ``Metric`` of a response: its attribute and its gauge's value (None: not a gauge)."""

    key: str
    attribute: Value
    gauge: int | float | str | bool | None


@dataclass(frozen=True)
class Response:
    """``MetricResponse``: the metric's name and its samples."""

    name: str
    samples: tuple[Sample, ...]


def metric_response(data: bytes) -> Response:
    name, samples = "", []
    for number, wire_type, value in fields(data):
        if number != 1:
            continue
        for inner in fields(_bytes(number, wire_type, value)):  # TPUMetric
            if inner[0] == 1:
                name = _text(*inner)
            elif inner[0] == 3:
                samples.append(_sample(_bytes(*inner)))
    return Response(name, tuple(samples))


def _sample(data: bytes) -> Sample:
    key, attribute, gauge = "", None, None  # type: tuple[str, Value, int | float | str | bool | None]
    for number, wire_type, value in fields(data):
        if number == 1:
            key, attribute = _attribute(_bytes(number, wire_type, value), 0)
        elif number == 3:
            gauge = _gauge(_bytes(number, wire_type, value))
    return Sample(key, attribute, gauge)


def _gauge(data: bytes) -> int | float | str | bool | None:
    found: int | float | str | bool | None = None
    for number, wire_type, value in fields(data):
        if number == 1:
            found = _double(number, wire_type, value)
        elif number == 2:
            found = _int(number, wire_type, value)
        elif number == 3:
            found = _text(number, wire_type, value)
        elif number == 4:
            found = bool(_int(number, wire_type, value))
    return found


def _attribute(data: bytes, depth: int) -> tuple[str, Value]:
    key, found = "", None  # type: tuple[str, Value]
    for number, wire_type, value in fields(data):
        if number == 1:
            key = _text(number, wire_type, value)
        elif number == 2:
            found = _attr_value(_bytes(number, wire_type, value), depth + 1)
    return key, found


def _attr_value(data: bytes, depth: int) -> Value:
    if depth > MAX_DEPTH:
        raise DecodeError(f"attribute values nested deeper than {MAX_DEPTH}")
    found: Value = None
    for number, wire_type, value in fields(data):
        if number == 1:
            found = _text(number, wire_type, value)
        elif number == 2:
            found = bool(_int(number, wire_type, value))
        elif number == 3:
            found = _int(number, wire_type, value)
        elif number == 4:
            found = _double(number, wire_type, value)
        elif number == 5:
            found = tuple(
                _attr_value(_bytes(*item), depth + 1)
                for item in fields(_bytes(number, wire_type, value))
                if item[0] == 1
            )
        elif number == 6:
            pairs = [
                _attribute(_bytes(*item), depth + 1)
                for item in fields(_bytes(number, wire_type, value))
                if item[0] == 1
            ]
            found = dict(pairs)
        elif number == 7:
            found = _bytes(number, wire_type, value)
    return found


def finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))
