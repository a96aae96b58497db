"""Which slice this host belongs to, from tpu-env and the machine type, and whether they agree.

A slice is many hosts (a v5p-1024 is 512 chips on 128 hosts of 4); tpu-env says which one this
is (``ACCELERATOR_TYPE``, ``TOPOLOGY``, ``CHIPS_PER_HOST_BOUNDS``, ``HOST_BOUNDS``, ``WORKER_ID``,
each also under a ``TPU_`` prefix on VMs created through Compute Engine) and the metadata
server's machine type says how many chips this VM has. :func:`read_slice` derives the chips this
host should have and checks every pair of those facts against each other and against the TPU
table (:data:`tpuboot.devices.table.GENERATIONS`): a disagreement is a :class:`Problem` naming the fix;
a generation or value the table does not know is a warning, never an exception.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from tpuboot.devices.table import GENERATIONS, Generation, generation_named, generation_of_machine
from tpuboot.env.tpuenv import env_value
from tpuboot.errors import shown

#: The fix for values that came wrong from metadata: the TPU API sets them per worker.
ENV_FIX = "correct the tpu-env instance attribute (the TPU API sets it per worker), then run tpuboot env"
KNOWN = ", ".join("/".join(g.prefixes) for g in GENERATIONS)


@dataclass(frozen=True)
class Problem:
    """Two facts about the slice that cannot both be true, and what to do."""

    what: str
    fix: str = ENV_FIX


@dataclass(frozen=True)
class Slice:
    """What is known of this host's slice; a field is None where nothing said it."""

    generation: Generation
    named_by: str  # which fact named the generation: "accelerator type v5p-8", "machine type ..."
    accelerator: str | None = None
    chips: int | None = None  # in the whole slice
    topology: str | None = None
    host_chips: int | None = None  # on this host
    host_chips_from: str = ""
    hosts: int | None = None
    worker: int | None = None


@dataclass(frozen=True)
class Reading:
    slice: Slice | None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _number(text: str) -> int | None:
    """A positive number of at most 6 ASCII digits (str.isdigit takes '²', which int() refuses)."""
    return int(text) if re.fullmatch(r"[0-9]{1,6}", text) and int(text) > 0 else None


def _dims(text: str, sep: str) -> tuple[int, ...] | None:
    parts = [_number(p) for p in text.lower().split(sep)]
    return None if None in parts else tuple(p for p in parts if p is not None)


def _padded(dims: tuple[int, ...], size: int) -> tuple[int, ...]:
    return dims + (1,) * (size - len(dims))


def _shape_ok(generation: Generation, dims: tuple[int, ...]) -> bool:
    if generation.shapes:
        return "x".join(map(str, sorted(dims))) in generation.shapes
    if generation.dims == 3:  # Cloud TPU's rule for 3D slices
        return all(d <= 4 for d in dims) or all(d % 4 == 0 for d in dims)
    return True


def _shown(dims: tuple[int, ...], sep: str) -> str:
    return sep.join(map(str, dims))


class _Reader:
    """One reading: the facts found so far, and what disagreed."""

    def __init__(self, env: Mapping[str, str], machine_type: str | None) -> None:
        self.env = env
        self.machine = machine_type.rsplit("/", 1)[-1] if machine_type else None
        self.problems: list[Problem] = []
        self.warnings: list[str] = []

    def fail(self, what: str, fix: str = ENV_FIX) -> None:
        self.problems.append(Problem(what, fix))

    def accelerator(self) -> tuple[Generation, str, int | None] | None:
        """(generation, accelerator type, chips) from ACCELERATOR_TYPE; None, warned, if unknown."""
        text = env_value(self.env, "ACCELERATOR_TYPE")
        if text is None:
            return None
        prefix, _, count = text.rpartition("-")
        generation = generation_named(prefix) if prefix else None
        if generation is None:
            self.warnings.append(
                f"accelerator type {shown(text)} is not a generation in tpuboot's TPU table ({KNOWN}): "
                "its slice and chip count are not checked"
            )
            return None
        number = _number(count)
        if number is None:
            self.fail(f"accelerator type {shown(text)} has no count (like {generation.prefixes[0]}-8)")
            return generation, text, None
        unit = "TensorCores, 2 per chip" if generation.per_chip == 2 else "chips"
        if number % generation.per_chip:
            self.fail(f"accelerator type {text} is not a whole number of chips (it counts {unit})")
            return generation, text, None
        chips = number // generation.per_chip
        if chips > generation.max_chips:
            pod = f"a {generation.kind} pod's {generation.max_chips}"
            self.fail(f"accelerator type {text} is {chips} chips, more than {pod}")
        return generation, text, chips

    def bounds(self, key: str) -> tuple[int, ...] | None:
        text = env_value(self.env, key)
        if text is None:
            return None
        dims = _dims(text, ",")
        if dims is None:
            self.fail(f"{key} {shown(text)} is not a list of positive numbers like 2,2,1")
        return dims

    def topology(self, generation: Generation, chips: int | None, acc: str | None) -> tuple[int, ...] | None:
        text = env_value(self.env, "TOPOLOGY")
        if text is None:
            return None
        dims = _dims(text, "x")
        like = "AxBxC" if generation.dims == 3 else "AxB"
        if dims is None:
            self.fail(f"TOPOLOGY {shown(text)} is not a shape like {like}")
            return None
        if len(dims) != generation.dims:
            have = f"{generation.kind} slices have {generation.dims} ({like})"
            self.fail(f"TOPOLOGY {text} has {len(dims)} dimensions; {have}")
            return None
        if chips is not None and math.prod(dims) != chips:
            self.fail(f"TOPOLOGY {text} is {math.prod(dims)} chips; accelerator type {acc} is {chips}")
        elif not _shape_ok(generation, dims):
            valid = ", ".join(generation.shapes) or "every side at most 4, or every side a multiple of 4"
            self.fail(f"TOPOLOGY {text} is not a {generation.kind} slice shape ({valid})")
        return dims


def read_slice(env: Mapping[str, str] | None, machine_type: str | None) -> Reading:
    """This host's slice as tpu-env (``env``) and the machine type describe it, and their conflicts."""
    r = _Reader(env or {}, machine_type)
    by_machine = generation_of_machine(r.machine) if r.machine else None
    by_accelerator = r.accelerator()
    if by_accelerator is None and by_machine is None:
        return Reading(None, r.problems, r.warnings)
    if by_accelerator is not None:
        generation, acc, chips = by_accelerator
        named_by = f"accelerator type {acc}"
    else:
        assert by_machine is not None  # both None returned above
        generation, acc, chips = by_machine[0], None, None
        named_by = f"machine type {r.machine}"
    if by_machine is not None and by_machine[0] is not generation:
        r.fail(
            f"machine type {r.machine} is a {by_machine[0].kind} VM, "
            f"but accelerator type {acc} is {generation.kind}",
            f"recreate the VM with a {generation.kind} machine type, or {ENV_FIX}",
        )
    dims = r.topology(generation, chips, acc)
    if chips is None and dims is not None:
        chips = math.prod(dims)
    per_host, host_bounds = r.bounds("CHIPS_PER_HOST_BOUNDS"), r.bounds("HOST_BOUNDS")

    # The chips this host has: its machine type says it best, else tpu-env's bounds, else the size.
    host_chips: int | None = None
    source = ""
    if by_machine is not None:
        host_chips, source = by_machine[1], f"machine type {r.machine}"
        if per_host is not None and math.prod(per_host) != host_chips:
            r.fail(
                f"CHIPS_PER_HOST_BOUNDS {_shown(per_host, ',')} is {math.prod(per_host)} chips per host; "
                f"machine type {r.machine} has {host_chips}"
            )
    elif per_host is not None:
        host_chips, source = math.prod(per_host), f"CHIPS_PER_HOST_BOUNDS {_shown(per_host, ',')}"
    elif chips is not None:
        host_chips = chips if chips <= generation.host_max else generation.host_chips
        if host_bounds is not None and chips % math.prod(host_bounds) == 0:
            # HOST_BOUNDS decides between the VM sizes of the generation (v6e-8 on 1 VM or 2).
            split = chips // math.prod(host_bounds)
            if split in {*generation.machine_types.values(), generation.host_chips}:
                host_chips = split
        source = named_by

    hosts: int | None = None
    if chips is not None and host_chips is not None:
        if chips % host_chips:
            r.fail(f"{named_by} is {chips} chips, not a whole number of hosts of {host_chips} ({source})")
        else:
            hosts = chips // host_chips
    if host_bounds is not None:
        if hosts is not None and math.prod(host_bounds) != hosts:
            shown = _shown(host_bounds, ",")
            r.fail(f"HOST_BOUNDS {shown} is {math.prod(host_bounds)} hosts; {named_by} is {hosts}")
        hosts = hosts or math.prod(host_bounds)
    if dims is not None and per_host is not None and host_bounds is not None:
        size = max(len(dims), len(per_host), len(host_bounds))
        pairs = zip(_padded(per_host, size), _padded(host_bounds, size), strict=True)
        product = tuple(a * b for a, b in pairs)
        if _padded(dims, size) != product:
            r.fail(
                f"TOPOLOGY {_shown(dims, 'x')} is not CHIPS_PER_HOST_BOUNDS {_shown(per_host, ',')} "
                f"times HOST_BOUNDS {_shown(host_bounds, ',')} ({_shown(product, 'x')})"
            )

    worker = _worker(r, hosts)
    topology = _shown(dims, "x") if dims else None
    found = Slice(generation, named_by, acc, chips, topology, host_chips, source, hosts, worker)
    return Reading(found, r.problems, r.warnings)


def _worker(r: _Reader, hosts: int | None) -> int | None:
    """WORKER_ID: a number from 0 to hosts - 1; required on a multi-host slice."""
    text = env_value(r.env, "WORKER_ID")
    if text is None:
        if hosts is not None and hosts > 1:
            r.fail(f"tpu-env has no WORKER_ID, and this is one of {hosts} hosts of a slice")
        return None
    if not re.fullmatch(r"[0-9]{1,6}", text):
        r.fail(f"WORKER_ID {shown(text)} is not a number from 0")
        return None
    worker = int(text)
    if hosts is not None and worker >= hosts:
        many = f"{hosts} hosts are workers 0 to {hosts - 1}" if hosts > 1 else "1 host is worker 0"
        r.fail(f"WORKER_ID {worker} is outside the slice: its {many}")
    return worker
