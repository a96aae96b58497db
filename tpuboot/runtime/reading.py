"""One port's answers as readings: per device duty cycle and HBM, and the two fault gauges.

The names are libtpu's (tpu-info's ``tpu_info/metrics.py``, GKE's device plugin); a device is
named by its metric's attribute, an int (older libtpu) or a string of digits (newer), or a
``device_ordinal``/``device-id`` in a key-value list. A sample of another shape is left out and
said once in :attr:`PortReading.problems`; the other samples and devices stand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpuboot.errors import printable
from tpuboot.runtime import wire
from tpuboot.runtime.client import Client

DUTY_CYCLE = "tpu.runtime.tensorcore.dutycycle.percent"
MEMORY_USED = "tpu.runtime.hbm.memory.usage.bytes"
MEMORY_TOTAL = "tpu.runtime.hbm.memory.total.bytes"
#: libtpu's fault gauges: a multislice hang (error_type HANG_DETECTED) and a slice error.
MEGASCALE_ERROR = "megascale.error.detected.gauge"
SLICE_ERROR = "slice.error.detected.gauge"
WANTED = (DUTY_CYCLE, MEMORY_USED, MEMORY_TOTAL, MEGASCALE_ERROR, SLICE_ERROR)
HANG_DETECTED = "HANG_DETECTED"
_DEVICE_KEYS = ("device_ordinal", "device-id", "device_id")


@dataclass(frozen=True)
class Device:
    """One device's reading (None: its libtpu did not say)."""

    device: str
    duty_cycle: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None


@dataclass(frozen=True)
class PortReading:
    """What one port said in one poll."""

    port: int
    devices: tuple[Device, ...] = ()
    hang: bool = False
    slice_error: str | None = None  # the error's message ("" when it gave none); None: no error
    problems: tuple[str, ...] = field(default=(), compare=False)


def device_of(sample: wire.Sample) -> str | None:
    """The device a sample is about, as digits; None when its attribute names none."""
    value = sample.attribute
    if isinstance(value, dict):
        value = next((value[k] for k in _DEVICE_KEYS if k in value), None)
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 0:
        return str(value)
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        return str(int(value))
    return None


def _number(value: object, integral: bool) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not wire.finite(value):
        return None
    if integral:
        return int(value) if value >= 0 and float(value).is_integer() else None
    return float(value)


def _per_device(response: wire.Response, integral: bool, problems: list[str]) -> dict[str, float | int]:
    found: dict[str, float | int] = {}
    bad = 0
    for sample in response.samples:
        device, value = device_of(sample), _number(sample.gauge, integral)
        if device is None or value is None:
            bad += 1
            continue
        found[device] = value
    if bad:
        problems.append(
            f"{response.name or 'a metric'}: {bad} sample{'s' if bad > 1 else ''} with an attribute "
            "or value of another type, left out"
        )
    return found


def _attributes(sample: wire.Sample) -> dict[str, str]:
    value = sample.attribute
    if not isinstance(value, dict):
        return {}
    return {str(k): printable(str(v)) for k, v in value.items() if isinstance(v, str | int | float)}


def hang_of(response: wire.Response) -> bool:
    """A megascale error gauge on, of type HANG_DETECTED (GKE's MegascaleHangDetected)."""
    return any(
        _attributes(s).get("error_type") == HANG_DETECTED and _number(s.gauge, False) not in (None, 0.0)
        for s in response.samples
    )


def slice_error_of(response: wire.Response) -> str | None:
    """The slice error gauge on: its error_message ("" if none); None when off."""
    for s in response.samples:
        if _number(s.gauge, False) not in (None, 0.0):
            return _attributes(s).get("error_message", "")[:200]
    return None


def read_port(client: Client) -> PortReading:
    """One poll of one port: ListSupportedMetrics, then each wanted metric it supports (CallError
    when the service does not answer as its interface says)."""
    supported = set(client.supported())
    problems: list[str] = []
    answers: dict[str, wire.Response] = {}
    for name in WANTED:
        if name in supported:
            response = client.metric(name)
            if response.name and response.name != name:
                problems.append(f"asked for {name}, answered {printable(response.name)[:80]}; left out")
                continue
            answers[name] = response
    empty = wire.Response("", ())
    duty = _per_device(answers.get(DUTY_CYCLE, empty), False, problems)
    used = _per_device(answers.get(MEMORY_USED, empty), True, problems)
    total = _per_device(answers.get(MEMORY_TOTAL, empty), True, problems)
    devices = tuple(
        Device(
            d,
            None if d not in duty else float(duty[d]),
            None if d not in used else int(used[d]),
            None if d not in total else int(total[d]),
        )
        for d in sorted({*duty, *used, *total}, key=int)
    )
    return PortReading(
        client.port,
        devices,
        hang=hang_of(answers.get(MEGASCALE_ERROR, empty)),
        slice_error=slice_error_of(answers.get(SLICE_ERROR, empty)),
        problems=tuple(problems),
    )
