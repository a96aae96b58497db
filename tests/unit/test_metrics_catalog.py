"""Each metric declared once (tpuboot/metrics_catalog.py): the exposition shows every declared
metric with its record's name, kind and help and no other; a name declared twice, or a record
prometheus_client could not show as it says, is refused; tpuboot's own names follow Prometheus'
conventions."""

from __future__ import annotations

import pytest

from tpuboot import metrics, metrics_catalog, metrics_export
from tpuboot.config import Config
from tpuboot.devices.table import DeviceTable
from tpuboot.metrics_catalog import CATALOG, Catalog, Metric
from tpuboot.paths import Root
from tpuboot.runtime.collector import Snapshot

#: How the text format writes each kind in its TYPE line.
TEXT_TYPE = {"gauge": "gauge", "counter": "counter", "histogram": "histogram", "info": "gauge"}


def exposed(top: Root) -> dict[str, tuple[str, str]]:
    """{name: (type, help)} of every family tpuboot shows: the daemon's registry with each
    collector it adds, and the slice's textfile; a counter's ``_created`` family left out (its
    counter's, written by prometheus_client 0.10 and later)."""
    with metrics.use(metrics.Metrics()) as fresh:
        metrics_export.watch_pcie(top, DeviceTable())
        metrics_export.watch_holders(top, Config())
        metrics_export.watch_runtime(Snapshot)
        text = metrics_export.exposition(fresh)
    text += metrics_export.slice_exposition(metrics_export.SliceSweep({}, 0, 0.0))
    helps, types = {}, {}
    for line in text.decode().splitlines():
        if line.startswith("# HELP "):
            name, _, words = line[len("# HELP ") :].partition(" ")
            helps[name] = words
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            types[name] = kind
    created = {f"{m.family}_created" for m in CATALOG if m.kind == "counter"}
    return {name: (kind, helps[name]) for name, kind in types.items() if name not in created}


def test_the_exposition_shows_every_declared_metric_and_no_other(tmp_path):
    declared = {m.name: (TEXT_TYPE[m.kind], m.help) for m in CATALOG}
    assert "tpuboot_pcie_present" in declared and "duty_cycle" in declared
    assert exposed(Root(tmp_path)) == declared


def test_every_record_of_the_catalog_module_is_declared():
    """A Metric made but not declared would be shown by nothing, or shown undeclared."""
    made = [value for value in vars(metrics_catalog).values() if isinstance(value, Metric)]
    assert len(made) == len(list(CATALOG)) and all(metric in list(CATALOG) for metric in made)


def test_a_metric_declared_twice_is_refused():
    catalog = Catalog()
    catalog.declare(Metric("tpuboot_x", "gauge", "X."))
    with pytest.raises(ValueError, match="metric tpuboot_x: declared twice"):
        catalog.declare(Metric("tpuboot_x", "gauge", "X again.", ("label",)))
    catalog.declare(Metric("tpuboot_y_total", "counter", "Y."))
    with pytest.raises(ValueError, match="declared twice"):
        catalog.declare(Metric("tpuboot_y_created", "gauge", "A name the counter's samples have."))
    catalog.declare(Metric("tpuboot_z_seconds", "histogram", "Z.", buckets=(1.0,)))
    with pytest.raises(ValueError, match="declared twice"):
        catalog.declare(Metric("tpuboot_z_seconds_count", "gauge", "A name the histogram's samples have."))
    assert [m.name for m in catalog] == ["tpuboot_x", "tpuboot_y_total", "tpuboot_z_seconds"]


@pytest.mark.parametrize(
    ("metric", "said"),
    [
        (Metric("tpuboot_x", "counter", "X."), "counter names end with _total"),
        (Metric("tpuboot_x", "info", "X."), "info names end with _info"),
        (Metric("tpuboot_x_seconds", "histogram", "X."), "a histogram, and only a histogram, has buckets"),
        (
            Metric("tpuboot_x", "gauge", "X.", buckets=(1.0,)),
            "a histogram, and only a histogram, has buckets",
        ),
        (Metric("tpuboot_x", "gauge", "X.", ("a-b",)), "not a Prometheus name"),
        (Metric("tpuboot_x", "gauge", "X.", ("a", "a")), "a label twice"),
    ],
)
def test_a_record_prometheus_client_could_not_show_is_refused(metric: Metric, said: str):
    with pytest.raises(ValueError, match=said):
        Catalog().declare(metric)


def test_tpuboots_own_names_follow_prometheus_conventions():
    """tpuboot_ prefix, base units at the end of the name, counters' _total; only libtpu's runtime
    metrics keep GKE's names (their unit said in their help)."""
    units = {m.unit for m in CATALOG if m.unit}
    assert {"seconds", "bytes"} <= units
    wrong = []
    for m in CATALOG:
        if not m.name.startswith("tpuboot_"):
            if m.source != "runtime" or m.unit not in m.help.lower():
                wrong.append(f"{m.name}: not tpuboot's name")
            continue
        base = m.family
        if m.unit and not base.endswith(f"_{m.unit}"):
            wrong.append(f"{m.name}: its name does not end with its unit {m.unit}")
        if not m.unit and any(base.endswith(f"_{unit}") for unit in units):
            wrong.append(f"{m.name}: its name ends with a unit it does not declare")
        if m.kind != "counter" and base.endswith("_total"):
            wrong.append(f"{m.name}: _total on a {m.kind}")
        if not m.help.endswith("."):
            wrong.append(f"{m.name}: its help is not a sentence")
    assert wrong == []
