"""What the CDI spec tells a container beyond its device nodes (issue 33): tpu-env's topology with
TPU_SKIP_MDS_QUERY, the metrics ports, vBar's relay socket and /tmp/tpu_logs; nothing of tpu-env
before it is known, the spec rewritten when it changes, a hostile value left out alone."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV, tpu_env_yaml
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import make, serving, until, with_env
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tests.unit.helpers.metadata import make_client
from tests.unit.helpers.pool import Pool
from tpuboot import cli
from tpuboot.config import Config, VbarConfig
from tpuboot.containers import cdi, cdi_file
from tpuboot.devices.chips import ChipFunction, group_chips
from tpuboot.devices.table import DeviceTable
from tpuboot.env.tpuenv import render_env_file


def chips(*functions: ChipFunction) -> list:
    return group_chips(functions, DeviceTable())


def devices(spec: dict) -> dict[str, dict]:
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


TWO_V5P = (ChipFunction("0000:00:04.0", "TPU v5p", "4"), ChipFunction("0000:00:05.0", "TPU v5p", "5"))


def env_of(edits: dict) -> dict[str, str]:
    return dict(entry.partition("=")[::2] for entry in edits.get("env", []))


def test_without_tpu_env_the_spec_says_no_topology_and_no_skip() -> None:
    spec = cdi.render(chips(*TWO_V5P), cdi.extras_of(None, vbar=False))
    assert spec is not None
    text = json.dumps(spec)
    assert "TPU_SKIP_MDS_QUERY" not in text and "TPU_TOPOLOGY" not in text
    assert "TPU_RUNTIME_METRICS_PORTS" not in text and "VBAR_CONTROL_SERVICE_URL" not in text
    assert env_of(devices(spec)["0"])["TPU_HOST_BOUNDS"] == "1,1,1"  # the chip's own, as before


def test_with_tpu_env_every_device_gets_the_topology_and_its_ports() -> None:
    tpu_env = {**SAMPLE_TPU_ENV, "TPU_WORKER_HOSTNAMES": "localhost"}  # a TPU_ name is read too
    spec = cdi.render(chips(*TWO_V5P), cdi.extras_of(tpu_env, vbar=False))
    assert spec is not None
    shared = env_of(spec["containerEdits"])
    assert shared == {
        "TPU_SKIP_MDS_QUERY": "true",
        "TPU_ACCELERATOR_TYPE": "v5p-8",
        "TPU_TOPOLOGY": "2x2x1",
        "TPU_TOPOLOGY_WRAP": "false,false,false",
        "TPU_TOPOLOGY_ALT": "false",
    }
    found = devices(spec)
    assert env_of(found["all"]) == {
        "TPU_HOST_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_RUNTIME_METRICS_PORTS": "8431,8432",
    }
    second = env_of(found["1"])
    assert second["TPU_RUNTIME_METRICS_PORTS"] == "8432" and second["TPU_VISIBLE_CHIPS"] == "1"
    assert (second["TPU_WORKER_ID"], second["TPU_WORKER_HOSTNAMES"]) == ("0", "localhost")
    assert second["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1"  # one chip: its bounds, not tpu-env's
    assert env_of(found["0"])["TPU_RUNTIME_METRICS_PORTS"] == "8431"


def test_a_tpu7x_chip_is_two_devices_with_two_ports() -> None:
    spec = cdi.render(
        chips(
            ChipFunction("0000:05:00.0", "TPU7x", "12"),
            ChipFunction("0000:05:00.1", "TPU7x", "13"),
            ChipFunction("0000:06:00.0", "TPU7x", "14"),
            ChipFunction("0000:06:00.1", "TPU7x", "15"),
        ),
        cdi.extras_of({"ACCELERATOR_TYPE": "tpu7x-8"}, vbar=False),
    )
    assert spec is not None
    found = devices(spec)
    assert env_of(found["all"])["TPU_RUNTIME_METRICS_PORTS"] == "8431,8432,8433,8434"
    assert env_of(found["1"])["TPU_RUNTIME_METRICS_PORTS"] == "8433,8434"


def test_the_relay_socket_is_mounted_where_gke_mounts_it_with_its_url() -> None:
    spec = cdi.render(chips(*TWO_V5P), cdi.extras_of(None, vbar=True))
    assert spec is not None
    edits = spec["containerEdits"]
    assert env_of(edits) == {"VBAR_CONTROL_SERVICE_URL": "unix:///var/run/tpu-plugin/vbar.sock"}
    assert {"hostPath": "/run/tpuboot/vbar", "containerPath": "/var/run/tpu-plugin"}.items() <= edits[
        "mounts"
    ][1].items()
    assert edits["mounts"][0]["containerPath"] == "/tmp/tpu_logs"


#: Beyond the metadata tests' hostile values, what only a YAML reader chokes on: a character beyond
#: U+FFFF (JSON's \\u escape of it is a surrogate pair, which CDI's YAML parser refuses), C1
#: controls (NEL is a YAML line break), the byte-order mark and the non-characters.
SPEC_HOSTILE = {
    **HOSTILE_VALUES,
    "ASTRAL": "chip 😀 \U0001d518",
    "NEL": "a\x85b",
    "C1": "a\x9bb",
    "DEL": "a\x7fb",
    "BOM": "a\ufeffb",
    "NONCHARACTER": "a\uffffb",
    "PRIVATE_USE": "a\ue000b",
}
#: What a YAML stream may hold (YAML 1.2, 5.1), but for the tab and line breaks: no env value holds one.
YAML_PRINTABLE = re.compile("[\x20-\x7e\xa0-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]*")


@pytest.mark.parametrize("key", sorted(SPEC_HOSTILE))
def test_a_hostile_value_is_kept_verbatim_or_left_out_alone(key: str) -> None:
    """Kept exactly if every character can be in a YAML file as it is, else left out alone; the
    spec reads back whole, in both formats, through a YAML parser that checks every character."""
    value = SPEC_HOSTILE[key]
    kept = value.strip()  # tpu-env's reader (env_value) trims the ends
    extras = cdi.extras_of({**SAMPLE_TPU_ENV, "TOPOLOGY": value}, vbar=True)
    spec = cdi.render(chips(*TWO_V5P), extras)
    assert spec is not None
    for data in (cdi.to_json(spec), cdi.to_yaml(spec)):
        assert b"\\u" not in data and b"\\U" not in data  # no escape a parser could misread
        assert yaml.safe_load(data.decode("utf-8")) == json.loads(cdi.to_json(spec))
    shared = env_of(json.loads(cdi.to_json(spec))["containerEdits"])
    if not YAML_PRINTABLE.fullmatch(kept):
        assert "TPU_TOPOLOGY" not in shared and list(extras.dropped) == ["TPU_TOPOLOGY"]
    elif kept:
        assert shared["TPU_TOPOLOGY"] == kept and not extras.dropped
    assert shared["TPU_ACCELERATOR_TYPE"] == "v5p-8"  # the rest stays


def test_non_utf8_and_huge_values_are_left_out() -> None:
    extras = cdi.extras_of({"TOPOLOGY": "a\udcff", "ACCELERATOR_TYPE": "v" * 5000, "WORKER_ID": "0"}, False)
    assert set(extras.dropped) == {"TPU_TOPOLOGY", "TPU_ACCELERATOR_TYPE"}
    assert extras.shared == ("TPU_SKIP_MDS_QUERY=true",) and extras.whole_host == ("TPU_WORKER_ID=0",)


def test_the_writer_rewrites_on_a_tpu_env_change_and_says_a_left_out_value_once(
    tmp_path: Path, caplog
) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    tpu_env: dict[str, str] | None = None
    pool, back = Pool(), []
    writer = cdi_file.SpecWriter(
        binder(kernel), pool, lambda fn, *a: back.append((fn, a)), lambda: cdi.extras_of(tpu_env, False)
    )  # type: ignore[arg-type]

    def written() -> dict:
        writer.refresh()
        pool.run_one()
        fn, args = back.pop()
        fn(*args)
        return json.loads(kernel.p(cdi.SPEC_PATH).read_text())

    assert "TPU_SKIP_MDS_QUERY" not in json.dumps(written())
    tpu_env = {"TOPOLOGY": "2x2x1", "ACCELERATOR_TYPE": "v5p-8\nEVIL=1"}
    with caplog.at_level(logging.WARNING, logger="tpuboot.containers.cdi"):
        for _ in range(2):
            shared = env_of(written()["containerEdits"])
            assert shared["TPU_TOPOLOGY"] == "2x2x1" and "TPU_ACCELERATOR_TYPE" not in shared
    lines = [r for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "TPU_ACCELERATOR_TYPE" in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage()
    tpu_env = {"TOPOLOGY": "4x4x4"}
    assert env_of(written()["containerEdits"])["TPU_TOPOLOGY"] == "4x4x4"
    assert kernel.p(cdi.TPU_LOGS_DIR).stat().st_mode & 0o7777 == 0o1777


def spec_env(kernel: FakeKernel) -> dict[str, str]:
    try:
        return env_of(json.loads(kernel.p(cdi.SPEC_PATH).read_text()).get("containerEdits", {}))
    except (FileNotFoundError, ValueError):
        return {}


def test_the_daemon_rewrites_the_spec_when_tpu_env_changes(tmp_path, emulator, root) -> None:
    kernel = FakeKernel(tmp_path / "kernel")
    add_tpu(kernel, "0000:00:04.0", V5P, driver=None, group="4")
    daemon, _, _ = make(
        kernel, config=with_env(emulator, watch=True), root=root, metadata=make_client(emulator)
    )
    with serving(daemon) as running:
        until(lambda: spec_env(kernel).get("TPU_TOPOLOGY") == "2x2x1")
        emulator.set_attribute("tpu-env", tpu_env_yaml({**SAMPLE_TPU_ENV, "TOPOLOGY": "4x4x1"}))
        until(lambda: spec_env(kernel).get("TPU_TOPOLOGY") == "4x4x1")
        running.stop()


def test_tpuboot_cdi_prints_the_env_from_the_tpu_env_file(tmp_path, capsys) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    path = kernel.p(Config().env.tpu_env_path)
    path.parent.mkdir(parents=True)
    path.write_text(render_env_file(SAMPLE_TPU_ENV))
    assert cli.main(["--root", str(kernel.top), "cdi"]) == 0
    printed = json.loads(capsys.readouterr().out)
    shared = env_of(printed["containerEdits"])
    assert shared["TPU_SKIP_MDS_QUERY"] == "true" and shared["TPU_ACCELERATOR_TYPE"] == "v5p-8"
    assert shared["VBAR_CONTROL_SERVICE_URL"] == cdi.VBAR_URL  # vBar on by default: its relay
    assert not cdi.relays_vbar(Config(vbar=VbarConfig(enabled=False)))
    assert not cdi.relays_vbar(Config(gke="true"))
