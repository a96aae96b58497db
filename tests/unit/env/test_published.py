"""What a worker publishes for the slice-wide comparison (tpuboot/env/published.py): a digest of
tpu-env's slice-wide keys that does not depend on key order or on the worker, and does on any
slice-wide value; and the daemon's guest attribute and metric carrying it."""

from __future__ import annotations

import hashlib

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.helpers.metadata import make_client, make_config
from tpuboot import metrics, metrics_export
from tpuboot.env.published import DIGEST_HEX, PER_WORKER, published, slice_digest
from tpuboot.env.results import SyncResult
from tpuboot.env.service import EnvService
from tpuboot.env.sync import EnvSync

ENV = {
    "ACCELERATOR_TYPE": "v5p-16",
    "TOPOLOGY": "2x2x2",
    "WORKER_ID": "1",
    "TPU_WORKER_ID": "1",
    "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080",
    "ZONE": "us-east5-a",
}


def test_the_digest_is_sha256_of_the_sorted_slice_wide_lines():
    lines = sorted(f"{k}={v}" for k, v in ENV.items() if k not in PER_WORKER)
    want = hashlib.sha256("".join(f"{line}\n" for line in lines).encode()).hexdigest()[:DIGEST_HEX]
    assert slice_digest(ENV) == want and len(want) == 16


def test_the_digest_does_not_depend_on_key_order():
    assert slice_digest(dict(reversed(list(ENV.items())))) == slice_digest(ENV)


def test_the_digest_leaves_out_the_per_worker_keys():
    other_worker = {**ENV, "WORKER_ID": "0", "TPU_WORKER_ID": "0"}
    assert slice_digest(other_worker) == slice_digest(ENV)
    assert published(other_worker).worker == 0 and published(ENV).worker == 1


def test_the_digest_changes_with_any_slice_wide_value():
    stale = {**ENV, "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.9:8080"}
    extra = {**ENV, "MEGASCALE_NUM_SLICES": "2"}
    assert len({slice_digest(ENV), slice_digest(stale), slice_digest(extra)}) == 3
    # KEY=value lines: a value cannot pass for the next key.
    assert slice_digest({"A": "1\nB=2"}) != slice_digest({"A": "1", "B": "2"})


def test_the_attribute_words_name_the_worker_only_when_tpu_env_does():
    assert published(ENV).attribute() == f"worker=1 digest={slice_digest(ENV)}"
    anonymous = {k: v for k, v in ENV.items() if k not in PER_WORKER}
    assert published(anonymous).attribute() == f"digest={slice_digest(ENV)}"


def identity_series() -> list[tuple[dict[str, str], float]]:
    text = metrics_export.exposition(metrics.current()).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return [(s.labels, s.value) for s in families["tpuboot_slice_identity_info"].samples]


def test_the_daemon_publishes_the_written_tpu_env_in_its_attribute_and_metric(emulator, root):
    """The emulator's tpu-env (14 keys, worker 0), synced: the attribute ends with this worker and
    digest, the metric carries the same; an absent tpu-env takes both away."""
    sync = EnvSync(root, make_config(emulator), make_client(emulator))
    service = EnvService(sync, 1.0, False)
    with metrics.use(metrics.Metrics()):
        assert identity_series() == []
        service.result(sync.sync_once(5.0))
        values = sync.parsed_values()
        assert values is not None
        mine = published(values)
        assert service.attribute().startswith("source=metadata keys=14 updated=20")
        assert service.attribute().endswith(f"Z {mine.attribute()}")
        assert identity_series() == [({"worker": str(mine.worker), "digest": mine.digest}, 1.0)]
        service.result(SyncResult("absent", 0, None, "tpu-env: not set"))
        assert service.attribute() == "source=absent" and identity_series() == []
