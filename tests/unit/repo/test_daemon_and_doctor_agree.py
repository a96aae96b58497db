"""The daemon and `tpuboot doctor` (or the bind, the status and the image check) give the same
answer on the same inputs: each states the fact through the one function that owns it (the GKE
question, the IOMMU fix, unsafe interrupts, the tpu-env cache's trust), and these tests keep the
two call paths from drifting apart in what they pass it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tests.unit.helpers.metadata import FAST_BACKOFF, INSTANCE_UUID, make_config
from tpuboot.checks.doctor import Doctor
from tpuboot.config import Config, VfioConfig
from tpuboot.containers.gke import gke_node
from tpuboot.devices.survey import survey
from tpuboot.devices.vfio import IOMMU_OFF_FIX, UNSAFE_INTERRUPTS
from tpuboot.env.cache import cache_path, read_cache
from tpuboot.env.sync import EnvSync
from tpuboot.errors import IommuOffError
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root

REPO = Path(__file__).resolve().parents[3]

# --- "is this a GKE node?" ------------------------------------------------------------------------

GKE_CASES = {
    "cluster-name set": ({"cluster-name": "c1"}, {}, True),
    "kube-env set, empty": ({"kube-env": ""}, {}, True),
    "kube-env set, not UTF-8": ({"kube-env": "x"}, {"body": b"\xff\xfe"}, True),
    "neither set": ({"other": "x"}, {}, False),
    "server refuses (403)": ({"cluster-name": "c1"}, {"status": 403}, None),
    "server errs (503)": ({}, {"status": 503}, None),
    "not the metadata server": ({"cluster-name": "c1"}, {"flavor": None}, None),
}


def daemon_says(client: MetadataClient) -> bool | None:
    """The daemon's answer (what Agents acts on): None if it is asking again, the first ask unanswered.

    Stopped once it has answered or said why it asks again (events, not a time that a loaded
    machine could overrun and turn an answer into None)."""
    stop, settled = threading.Event(), threading.Event()
    found: list[bool | None] = []

    def ask() -> None:
        found.append(gke_node("auto", client, stop, deadline_s=0.3, unanswered=lambda why: settled.set()))
        settled.set()

    thread = threading.Thread(target=ask)
    thread.start()
    assert settled.wait(30)
    stop.set()
    client.close()  # as Agents.stop does: cuts a try in flight
    thread.join(10)
    return found[0]


def doctor_says(client: MetadataClient, tmp_path: Path) -> bool | None:
    """Doctor's answer, read from its vBar check (True: skipped as GKE's, None: cannot tell)."""
    kernel = FakeKernel(tmp_path / "root")
    config = Config()
    (vbar,) = [
        v.result
        for v in Doctor(
            kernel.root,
            config,
            metadata=client,
            container_state=lambda root, name: "running",
        ).run()
        if v.result.name == "vbar-running"
    ]
    if vbar.detail.startswith("a GKE node ("):
        return True
    if vbar.detail.startswith("cannot tell whether this is a GKE node"):
        return None
    return False


@pytest.mark.parametrize("case", sorted(GKE_CASES))
def test_the_daemon_and_doctor_give_the_same_gke_answer(case: str, tmp_path: Path) -> None:
    attributes, faults, expected = GKE_CASES[case]
    with MetadataEmulator(attributes) as emu:
        emu.set_faults(**faults)

        def client() -> MetadataClient:
            return MetadataClient(emu.url, timeout=0.3, backoff=FAST_BACKOFF)

        assert (daemon_says(client()), doctor_says(client(), tmp_path)) == (expected, expected)


def test_a_silent_server_is_no_answer_for_both(tmp_path: Path) -> None:
    with MetadataEmulator({"cluster-name": "c1"}) as emu:
        emu.stop()  # refused from now on: its port stays held, so no other test's server answers there
        assert daemon_says(MetadataClient(emu.url, timeout=0.3, backoff=FAST_BACKOFF)) is None
        assert doctor_says(MetadataClient(emu.url, timeout=0.3, backoff=FAST_BACKOFF), tmp_path) is None


def test_without_a_server_to_ask_auto_is_no_answer_for_both(tmp_path: Path) -> None:
    """The daemon's old shortcut (no client: not GKE) is gone; neither side guesses."""
    stop = threading.Event()
    found: list[bool | None] = []
    thread = threading.Thread(target=lambda: found.append(gke_node("auto", None, stop)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # still waiting for an answer
    stop.set()
    thread.join(10)
    assert found == [None]
    root = FakeKernel(tmp_path / "root").root
    (vbar,) = Doctor(root, Config()).checks.run(root, ["vbar-running"])
    assert vbar.detail.startswith("cannot tell whether this is a GKE node: ")


# --- the IOMMU is off -------------------------------------------------------------------------------


def test_bind_status_and_doctor_give_the_same_iommu_fix(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path / "root")
    add_tpu(kernel, group=None)
    with pytest.raises(IommuOffError) as caught:
        binder(kernel).bind("0000:00:04.0")
    assert str(caught.value).endswith(f"the IOMMU is off; {IOMMU_OFF_FIX}")
    (tpu,) = survey(binder(kernel))
    assert tpu.problem == f"no IOMMU group, the IOMMU is off; {IOMMU_OFF_FIX}"
    (groups,) = [
        v.result for v in Doctor(kernel.root, Config()).run() if v.result.name == "iommu-groups-viable"
    ]
    assert (groups.status, groups.fix) == ("FAIL", IOMMU_OFF_FIX)


# --- vfio_iommu_type1 allow_unsafe_interrupts ----------------------------------------------------------


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("setting", ["auto", "true", "false"])
def test_doctor_checks_unsafe_interrupts_exactly_where_bind_sets_them(
    setting: str, machine: str, tmp_path: Path
) -> None:
    """Right after `tpuboot bind`, doctor passes what bind set and skips what it left alone."""
    kernel = FakeKernel(tmp_path / "root")
    add_tpu(kernel, "0000:00:04.0", V5P)
    kernel.load_module("vfio_iommu_type1")
    kernel.p(UNSAFE_INTERRUPTS).write_text("N\n")
    binder(kernel, machine=machine, allow_unsafe_interrupts=setting).bind("0000:00:04.0")
    set_by_bind = kernel.p(UNSAFE_INTERRUPTS).read_text().strip() in ("Y", "1")
    kernel.p("/proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    kernel.p("/proc/sys/kernel/arch").write_text(machine + "\n")
    config = Config(vfio=VfioConfig(allow_unsafe_interrupts=setting))
    check = Doctor(kernel.root, config).check_unsafe_interrupts()
    assert check.status == ("PASS" if set_by_bind else "SKIP"), check
    assert set_by_bind == (setting == "true" or (setting == "auto" and machine == "x86_64"))


# --- the tpu-env cache ------------------------------------------------------------------------------------

CACHE_RECORDS = {
    "this instance's": {"format": 2, "product_uuid": INSTANCE_UUID},
    "a clone's": {"format": 2, "product_uuid": "0f0e0d0c-0b0a-4908-8706-050403020100"},
    "an older tpuboot's": {"format": 1},
    "of no instance": {"format": 2, "product_uuid": None},
    "of an unknown format": {"format": 3, "product_uuid": INSTANCE_UUID},
}


@pytest.mark.parametrize("record", sorted(CACHE_RECORDS))
def test_doctor_trusts_the_cache_exactly_when_the_daemon_uses_it(record: str, root: Root) -> None:
    """The metadata server is down: the sync writes tpu-env from the cache if it is this instance's;
    doctor then finds the file fresh, and otherwise names the reason the daemon logged."""
    config = make_config()
    yaml = "ACCELERATOR_TYPE: v5p-8\nWORKER_ID: '0'\n"
    fields = {"fetched": "2026-11-29T20:00:00+00:00", "etag": "e1", "tpu_env": yaml, **CACHE_RECORDS[record]}
    cache = root.path(cache_path(config))
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(fields))
    root.path(config.env.tpu_env_path).write_text('ZONE="from an older boot"\n')
    with MetadataEmulator() as emu:
        emu.stop()  # refused from now on: its port stays held, so no other test's server answers there
        client = MetadataClient(emu.url, timeout=0.2, backoff=FAST_BACKOFF)
        used = EnvSync(root, config, client).sync_once(0.3).source == "cache"
    state = read_cache(root, config)
    fresh = Doctor(root, config).tpu_env.check_tpu_env_fresh()
    assert used == (record == "this instance's")
    if used:
        assert fresh.status == "PASS" and "matches the last value fetched" in fresh.detail
    else:
        assert state.problem is not None
        assert fresh.status == "FAIL" and fresh.detail.startswith(state.problem)
