"""The slice a host belongs to, from tpu-env and the machine type (tpuboot/slice/shape.py): the chips this
host should have on single- and multi-host slices of every generation in the TPU table, every
disagreement between the facts as a problem with a fix, and unknown or hostile values as
warnings or problems, never an exception."""

from __future__ import annotations

import pytest

from tpuboot.devices.table import (
    GENERATIONS,
    REPORT_KINDS,
    VFIO_KINDS,
    generation_of_machine,
    generations_of_kind,
)
from tpuboot.slice.shape import read_slice

MACHINE = "projects/1/zones/us-east5-a/machineTypes/"


def env(accelerator: str | None = None, **keys: str) -> dict[str, str]:
    values = dict(keys)
    if accelerator is not None:
        values["ACCELERATOR_TYPE"] = accelerator
    return values


# (tpu-env, machine type) -> (chips in the slice, chips on this host, hosts, worker)
AGREEING = [
    # v5p-1024: 512 chips on 128 hosts of 4, as the TPU API describes each worker.
    (
        env("v5p-1024", TOPOLOGY="8x8x8", CHIPS_PER_HOST_BOUNDS="2,2,1", HOST_BOUNDS="4,4,8", WORKER_ID="5"),
        None,
        (512, 4, 128, 5),
    ),
    (env("v5p-1024", WORKER_ID="127"), MACHINE + "ct5p-hightpu-4t", (512, 4, 128, 127)),
    (env("v5p-8", TOPOLOGY="2x2x1", WORKER_ID="0"), None, (4, 4, 1, 0)),
    (env("v4-8"), None, (4, 4, 1, None)),
    (env("v4-16", TOPOLOGY="2x2x2", WORKER_ID="1"), "ct4p-hightpu-4t", (8, 4, 2, 1)),
    (env("v3-32", WORKER_ID="3"), None, (16, 4, 4, 3)),
    # v5e: 8 chips on one VM through the TPU API (ct5lp-hightpu-8t), or on two through GKE's 4t.
    (env("v5litepod-8", TOPOLOGY="2x4"), None, (8, 8, 1, None)),
    (env("v5litepod-8", TOPOLOGY="2x4", WORKER_ID="1"), "ct5lp-hightpu-4t", (8, 4, 2, 1)),
    (env("v5litepod-16", TOPOLOGY="4x4", WORKER_ID="2"), None, (16, 4, 4, 2)),
    (env("v5litepod-1", TOPOLOGY="1x1"), "ct5lp-hightpu-1t", (1, 1, 1, None)),
    (env("v5litepod-256", TOPOLOGY="16x16", WORKER_ID="63"), "ct5lp-hightpu-4t", (256, 4, 64, 63)),
    # v6e (Cloud TPU's v6e page): 2x4 on one ct6e-standard-8t, or two VMs by tpu-env's bounds.
    (env("v6e-8"), MACHINE + "ct6e-standard-8t", (8, 8, 1, None)),
    (
        env("v6e-8", TOPOLOGY="2x4", CHIPS_PER_HOST_BOUNDS="2,2,1", HOST_BOUNDS="1,2,1", WORKER_ID="0"),
        None,
        (8, 4, 2, 0),
    ),
    (env("v6e-256", TOPOLOGY="16x16", WORKER_ID="63"), "ct6e-standard-4t", (256, 4, 64, 63)),
    (env("v6e-4", TOPOLOGY="2x2"), "ct6e-standard-4t", (4, 4, 1, None)),
    # TPU7x: the count is TensorCores, 2 per chip (tpu7x-8 is one 4-chip VM).
    (env("tpu7x-8", TOPOLOGY="2x2x1"), "tpu7x-standard-4t", (4, 4, 1, None)),
    (env("tpu7x-128", TOPOLOGY="4x4x4", WORKER_ID="15"), "tpu7x-standard-4t", (64, 4, 16, 15)),
    (env("tpu7x-2"), "tpu7x-standard-1t", (1, 1, 1, None)),
    # Compute Engine's spelling of the keys.
    ({"TPU_ACCELERATOR_TYPE": "v6e-16", "TPU_WORKER_ID": "3"}, None, (16, 4, 4, 3)),
    # Only the machine type: this host's chips, nothing of the slice.
    ({}, MACHINE + "ct5p-hightpu-4t", (None, 4, None, None)),
    (env("v5p-8", WORKER_ID=""), None, (4, 4, 1, None)),  # an empty value is no value
]


@pytest.mark.parametrize(("values", "machine", "expected"), AGREEING)
def test_agreeing_facts_give_the_chips_on_this_host(values, machine, expected):
    reading = read_slice(values, machine)
    assert (reading.problems, reading.warnings) == ([], [])
    found = reading.slice
    assert (found.chips, found.host_chips, found.hosts, found.worker) == expected


# (tpu-env, machine type) -> what the problem says
DISAGREEING = [
    (env("v5p-8", TOPOLOGY="2x2x2"), None, "TOPOLOGY 2x2x2 is 8 chips; accelerator type v5p-8 is 4"),
    (env("v5p-16", TOPOLOGY="4x2"), None, "TOPOLOGY 4x2 has 2 dimensions; TPU v5p slices have 3 (AxBxC)"),
    (env("v5p-48", TOPOLOGY="2x2x6"), None, "TOPOLOGY 2x2x6 is not a TPU v5p slice shape"),
    (env("v6e-32", TOPOLOGY="2x16"), None, "TOPOLOGY 2x16 is not a TPU v6e slice shape (1x1, 2x2, 2x4"),
    (env("v6e-16", TOPOLOGY="big"), None, "TOPOLOGY 'big' is not a shape like AxB"),
    (env("v5p-7"), None, "accelerator type v5p-7 is not a whole number of chips (it counts TensorCores"),
    (env("v5p-0"), None, "accelerator type 'v5p-0' has no count (like v5p-8)"),
    (env("v5p-20000"), None, "accelerator type v5p-20000 is 10000 chips, more than a TPU v5p pod's 8960"),
    (env("v5p-8", WORKER_ID="1"), None, "WORKER_ID 1 is outside the slice: its 1 host is worker 0"),
    (
        env("v5p-1024", WORKER_ID="128"),
        None,
        "WORKER_ID 128 is outside the slice: its 128 hosts are workers 0 to 127",
    ),
    (env("v5p-1024"), None, "tpu-env has no WORKER_ID, and this is one of 128 hosts of a slice"),
    (env("v5p-8", WORKER_ID="-1"), None, "WORKER_ID '-1' is not a number from 0"),
    (env("v5p-8", WORKER_ID="²"), None, "WORKER_ID '²' is not a number from 0"),
    (
        env("v5p-8"),
        MACHINE + "ct6e-standard-4t",
        "machine type ct6e-standard-4t is a TPU v6e VM, but accelerator type v5p-8 is TPU v5p",
    ),
    (
        env("v5p-8", CHIPS_PER_HOST_BOUNDS="2,4,1"),
        "ct5p-hightpu-4t",
        "CHIPS_PER_HOST_BOUNDS 2,4,1 is 8 chips per host; machine type ct5p-hightpu-4t has 4",
    ),
    (
        env("v5p-1024", HOST_BOUNDS="4,4,4", WORKER_ID="0"),
        None,
        "HOST_BOUNDS 4,4,4 is 64 hosts; accelerator type v5p-1024 is 128",
    ),
    (
        env("v5p-32", TOPOLOGY="2x2x4", CHIPS_PER_HOST_BOUNDS="2,2,1", HOST_BOUNDS="1,2,2", WORKER_ID="0"),
        None,
        "TOPOLOGY 2x2x4 is not CHIPS_PER_HOST_BOUNDS 2,2,1 times HOST_BOUNDS 1,2,2 (2x4x2)",
    ),
    (
        env("v5litepod-4"),
        "ct5lp-hightpu-8t",
        "accelerator type v5litepod-4 is 4 chips, not a whole number of hosts of 8",
    ),
    (env("v5p-8", CHIPS_PER_HOST_BOUNDS="2;2;1"), None, "CHIPS_PER_HOST_BOUNDS '2;2;1' is not a list"),
]


@pytest.mark.parametrize(("values", "machine", "says"), DISAGREEING)
def test_each_disagreement_is_a_problem_with_a_fix(values, machine, says):
    reading = read_slice(values, machine)
    assert reading.warnings == []
    assert any(says in p.what for p in reading.problems), reading.problems
    assert all(p.fix and "\n" not in p.fix for p in reading.problems)


def test_a_machine_of_another_generation_names_the_fix_for_either_side():
    (problem,) = read_slice(env("tpu7x-8"), "ct5p-hightpu-4t").problems
    assert problem.fix.startswith("recreate the VM with a TPU7x machine type, or correct the tpu-env")


@pytest.mark.parametrize("accelerator", ["v9-huge", "tpu8t-8", "garbage", "-8", "x" * 5000])
def test_a_generation_outside_the_table_is_a_warning_not_a_problem(accelerator):
    reading = read_slice(env(accelerator, WORKER_ID="9"), None)
    assert reading.slice is None and reading.problems == []
    (warning,) = reading.warnings
    assert (
        "is not a generation in tpuboot's TPU table (v2, v3, v4, v5litepod/v5e, v5p, v6e, tpu7x)" in warning
    )
    assert len(warning) < 300  # a megabyte value is not repeated whole


HOSTILE = [
    "",
    " ",
    "0",
    "-1",
    "99999999999999999999",
    "1e9",
    "²",
    "٣",
    "8x",
    "x8",
    ",",
    "2,,1",
    "a\nb",
    "$(x)",
]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize(
    "key", ["ACCELERATOR_TYPE", "TOPOLOGY", "CHIPS_PER_HOST_BOUNDS", "HOST_BOUNDS", "WORKER_ID"]
)
def test_no_value_raises(key, value):
    values = env(
        "v5p-16", TOPOLOGY="2x2x2", CHIPS_PER_HOST_BOUNDS="2,2,1", HOST_BOUNDS="1,1,2", WORKER_ID="1"
    )
    values[key] = value
    reading = read_slice(values, "ct5p-hightpu-4t")
    if key == "ACCELERATOR_TYPE" and value.strip():
        assert reading.problems or reading.warnings
    assert reading.slice is None or reading.slice.host_chips == 4  # the machine type still says it


def test_no_tpu_env_and_no_tpu_machine_is_nothing_to_judge():
    assert read_slice(None, None).slice is None
    assert read_slice({"ZONE": "z"}, MACHINE + "n2-standard-8") == read_slice(None, None)


def test_the_table_is_one_table():
    """Every machine type belongs to one generation, and each generation's chips are a PCI kind of
    the same table that names it back."""
    machines = [m for g in GENERATIONS for m in g.machine_types]
    assert len(machines) == len(set(machines))
    assert generation_of_machine("ct6e-standard-8t")[1] == 8
    assert generation_of_machine("n2-standard-8") is None
    names = {kind.name for kind in (*VFIO_KINDS, *REPORT_KINDS)}
    for generation in GENERATIONS:
        assert generation.kind in names
        assert generation.key in generations_of_kind(generation.kind)
    assert generations_of_kind("configured 1ae0:0083") == ()
