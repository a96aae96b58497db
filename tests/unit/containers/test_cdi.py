"""The CDI spec: rendered from the chips alone, kept by the daemon through bind, unbind, hot remove
and stop, printed by `tpuboot cdi`. Its real consumers (podman, Docker) are tests/vm/test_cdi.py's."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.daemon import make, serving, until
from tests.unit.helpers.devices import V4, V5P, add, add_tpu, binder, surveyed
from tests.unit.helpers.pool import Pool
from tpuboot import cli
from tpuboot.containers import cdi, cdi_file
from tpuboot.devices.chips import ChipFunction, chips_present, group_chips
from tpuboot.devices.table import DeviceTable

#: The device-name grammar of SPEC.md ("CDI Devices"), with the leading digit 0.5.0 allows.
NAME = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
LOGS_MOUNT = {
    "hostPath": "/var/log/tpuboot/tpu_logs",
    "containerPath": "/tmp/tpu_logs",
    "options": ["rw", "nosuid", "nodev", "bind"],
}


def chips(*functions: ChipFunction) -> list:
    return group_chips(functions, DeviceTable())


def devices(spec: dict) -> dict[str, dict]:
    return {d["name"]: d["containerEdits"] for d in spec["devices"]}


def test_one_device_per_chip_by_index_and_address_and_all_with_the_vfio_container() -> None:
    spec = cdi.render(
        chips(ChipFunction("0000:00:05.0", "TPU v5p", "5"), ChipFunction("0000:00:04.0", "TPU v5p", "4"))
    )
    assert spec is not None
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "google.com/tpu")
    found = devices(spec)
    assert list(found) == ["0", "0000-00-04", "1", "0000-00-05", "all"]
    assert found["0"] == found["0000-00-04"]
    assert found["1"]["deviceNodes"] == [{"path": "/dev/vfio/5"}]
    assert "TPU_VISIBLE_CHIPS=1" in found["1"]["env"]
    assert "TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1" in found["1"]["env"]
    assert found["all"] == {"deviceNodes": [{"path": "/dev/vfio/4"}, {"path": "/dev/vfio/5"}]}  # no selection
    assert spec["containerEdits"] == {"deviceNodes": [{"path": "/dev/vfio/vfio"}], "mounts": [LOGS_MOUNT]}
    assert all(NAME.match(name) for name in found)


def test_a_two_function_chip_is_one_device_with_both_groups() -> None:
    spec = cdi.render(
        chips(ChipFunction("0000:05:00.1", "TPU7x", "13"), ChipFunction("0000:05:00.0", "TPU7x", "12"))
    )
    assert spec is not None
    found = devices(spec)
    assert list(found) == ["0", "0000-05-00", "all"]
    assert found["0"]["deviceNodes"] == [{"path": "/dev/vfio/12"}, {"path": "/dev/vfio/13"}]


def test_accel_chips_get_their_accel_nodes_and_no_vfio_container(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    add(kernel, "0000:00:04.0", V4, None, driver="accel-tpu")
    kernel.p("/sys/bus/pci/devices/0000:00:04.0/accel/accel0").mkdir(parents=True)
    table = DeviceTable()
    spec = cdi.render(chips_present(kernel.root, table, surveyed(kernel, table)))
    assert spec is not None
    assert devices(spec)["0"]["deviceNodes"] == [{"path": "/dev/accel0"}]
    assert spec["containerEdits"] == {"mounts": [LOGS_MOUNT]}  # no /dev/vfio/vfio


def test_no_usable_chip_is_no_spec(tmp_path: Path) -> None:
    assert cdi.render([]) is None
    assert cdi.render(chips(ChipFunction("0000:00:04.0", "TPU v5p", None))) is None  # not bound


def test_the_file_is_written_atomically_and_removed_when_no_chip_is_left(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    spec = cdi.render(chips(ChipFunction("0000:00:04.0", "TPU v5p", "4")))
    assert cdi_file.apply(kernel.root, spec) is True
    path = kernel.p(cdi.SPEC_PATH)
    assert json.loads(path.read_text()) == spec and path.stat().st_mode & 0o777 == 0o644
    assert cdi_file.apply(kernel.root, spec) is False  # unchanged: not rewritten
    assert cdi_file.apply(kernel.root, None) is True and not path.exists()
    assert cdi_file.apply(kernel.root, None) is False


@pytest.mark.parametrize("relay", [True, False])
def test_the_writer_makes_the_relays_directory_the_spec_mounts(tmp_path: Path, relay: bool) -> None:
    """vBar's relay starts after READY, the spec before it: a container started in between must
    find the directory the spec mounts (its socket comes with the relay)."""
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    pool = Pool()
    writer = cdi_file.SpecWriter(binder(kernel), pool, lambda fn, *a: None, lambda: cdi.Extras(vbar=relay))  # type: ignore[arg-type]
    writer.refresh()
    pool.run_one()
    mounts = json.loads(kernel.p(cdi.SPEC_PATH).read_text())["containerEdits"]["mounts"]
    assert (cdi.RELAY_DIR in [m["hostPath"] for m in mounts]) is relay
    directory = kernel.p(cdi.RELAY_DIR)
    assert directory.is_dir() is relay
    assert not relay or directory.stat().st_mode & 0o7777 == 0o755


def test_yaml_says_what_json_says() -> None:
    spec = cdi.render(chips(ChipFunction("0000:00:04.0", "TPU v5p", "4")))
    assert spec is not None
    assert yaml.safe_load(cdi.to_yaml(spec)) == json.loads(cdi.to_json(spec)) == spec


def test_yaml_has_no_anchor_or_alias() -> None:
    """A chip's two names share one edits object: the YAML writes it out twice, plainly."""
    spec = cdi.render(chips(ChipFunction("0000:00:04.0", "TPU v5p", "4")))
    assert spec is not None
    events = list(yaml.parse(cdi.to_yaml(spec)))
    assert not [e for e in events if isinstance(e, yaml.AliasEvent) or getattr(e, "anchor", None)]
    edits = [e for e in events if isinstance(e, yaml.ScalarEvent) and e.value == "containerEdits"]
    assert len(edits) == 4  # the chip's two names, all, and the spec's own


def test_refreshes_asked_for_while_one_runs_run_once_after_it_and_see_the_last_state(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    pool, on_loop = Pool(), []
    writer = cdi_file.SpecWriter(binder(kernel), pool, lambda fn, *a: on_loop.append((fn, a)))  # type: ignore[arg-type]
    writer.refresh()
    add_tpu(kernel, "0000:00:05.0", V5P, driver="vfio-pci", group="5")
    writer.refresh()
    writer.refresh()
    assert len(pool.jobs) == 1  # one at a time
    pool.run_one()
    fn, args = on_loop.pop()
    fn(*args)  # back on the loop: the refresh asked for meanwhile starts now
    assert len(pool.jobs) == 1
    pool.run_one()
    assert list(devices(json.loads(kernel.p(cdi.SPEC_PATH).read_text()))) == [
        "0",
        "0000-00-04",
        "1",
        "0000-00-05",
        "all",
    ]


def test_no_write_lands_after_stop(tmp_path: Path) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    pool = Pool()
    writer = cdi_file.SpecWriter(binder(kernel), pool, lambda fn, *a: None)  # type: ignore[arg-type]
    writer.refresh()
    writer.stop()
    pool.run_one()  # a write that was queued before the stop
    assert not kernel.p(cdi.SPEC_PATH).exists()


def test_a_failed_write_is_logged_and_the_next_change_is_written(tmp_path: Path, caplog) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    kernel.p("/var/run").mkdir(parents=True)
    kernel.p(cdi.SPEC_DIR).write_text("a file where the directory goes")
    with ThreadPoolExecutor(1) as pool:
        back: list = []
        writer = cdi_file.SpecWriter(binder(kernel), pool, lambda fn, *a: back.append((fn, a)))
        writer.refresh()
        until(lambda: back)
        fn, args = back.pop()
        fn(*args)
        assert "CDI spec /var/run/cdi/google.com-tpu.json" in caplog.text
        kernel.p(cdi.SPEC_DIR).unlink()
        writer.refresh()
        until(lambda: back)
    assert kernel.p(cdi.SPEC_PATH).exists()


@pytest.fixture
def kernel(tmp_path):
    k = FakeKernel(tmp_path)
    for i in range(2):
        add_tpu(k, f"0000:00:0{4 + i}.0", V5P, driver=None, group=str(4 + i))
    return k


def spec_names(kernel: FakeKernel) -> list[str] | None:
    try:
        return list(devices(json.loads(kernel.p(cdi.SPEC_PATH).read_text())))
    except FileNotFoundError:
        return None


def test_the_daemon_keeps_the_spec_through_hotplug_unbind_and_stop(kernel) -> None:
    daemon, monitor, _ = make(kernel)
    with serving(daemon) as running:
        until(lambda: spec_names(kernel) == ["0", "0000-00-04", "1", "0000-00-05", "all"])
        add_tpu(kernel, "0000:00:0a.0", V5P, group="10")
        monitor.push("add", "pci", "0000:00:0a.0")
        until(lambda: spec_names(kernel) == ["0", "0000-00-04", "1", "0000-00-05", "2", "0000-00-0a", "all"])
        kernel.remove_device("0000:00:0a.0")
        monitor.push("remove", "pci", "0000:00:0a.0")
        until(lambda: spec_names(kernel) == ["0", "0000-00-04", "1", "0000-00-05", "all"])
        kernel.write(kernel.p("/sys/bus/pci/devices/0000:00:04.0/driver/unbind"), "0000:00:04.0")
        monitor.push("unbind", "pci", "0000:00:04.0")  # `tpuboot unbind` in another process
        until(lambda: spec_names(kernel) == ["1", "0000-00-05", "all"])  # numbered among all chips
        assert running.stop() == 0
    assert spec_names(kernel) is None  # removed at stop


def test_a_stale_spec_of_a_past_run_goes_when_no_chip_is_bound(tmp_path) -> None:
    kernel = FakeKernel(tmp_path)
    cdi_file.apply(kernel.root, cdi.render(chips(ChipFunction("0000:00:04.0", "TPU v5p", "4"))))
    daemon, _, _ = make(kernel)
    with serving(daemon):
        until(lambda: daemon.ready)
        until(lambda: spec_names(kernel) is None)


def test_tpuboot_cdi_prints_json_or_yaml_and_writes_a_file(kernel, capsys, tmp_path) -> None:
    for address in ("0000:00:04.0", "0000:00:05.0"):
        binder(kernel).bind(address)
    assert cli.main(["--root", str(kernel.top), "cdi"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(devices(printed)) == ["0", "0000-00-04", "1", "0000-00-05", "all"]
    assert cli.main(["--root", str(kernel.top), "cdi", "--format", "yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == printed
    assert cli.main(["--root", str(kernel.top), "cdi", "--output", "/etc/cdi/tpu.json"]) == 0
    assert json.loads(kernel.p("/etc/cdi/tpu.json").read_text()) == printed


def test_cdi_output_under_root_is_a_file_in_the_tree(kernel, capsys, tmp_path, monkeypatch) -> None:
    """--output under --root is a path inside the root, resolved there as every path is (an
    absolute link in the tree leads to the tree's file, never the host's); a relative one names no
    place in the tree and is refused in one line, nothing written."""
    binder(kernel).bind("0000:00:04.0")
    root = ["--root", str(kernel.top)]
    kernel.p("/srv/cdi").mkdir(parents=True)
    kernel.p("/etc/cdi").parent.mkdir(parents=True, exist_ok=True)
    kernel.p("/etc/cdi").symlink_to("/srv/cdi")  # the image's own link: its /srv, not the host's
    assert cli.main([*root, "cdi", "--output", "/etc/cdi/tpu.json"]) == 0
    assert json.loads(kernel.p("/srv/cdi/tpu.json").read_text())["kind"] == "google.com/tpu"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for relative in ("tpu.json", "etc/cdi/tpu2.json", "../tpu3.json"):
        assert cli.main([*root, "cdi", "--output", relative]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and f"--output {relative} under --root: give the file's absolute path" in err
        )
    assert sorted(p.name for p in elsewhere.iterdir()) == []
    assert sorted(p.name for p in kernel.p("/srv/cdi").iterdir()) == ["tpu.json"]


def test_tpuboot_cdi_without_a_bound_chip_is_a_one_line_error(kernel, capsys) -> None:
    assert cli.main(["--root", str(kernel.top), "cdi"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tpuboot status says why" in err


def test_a_driver_change_reports_only_when_no_bind_of_ours_runs(kernel) -> None:
    """Our own bind's udev ``bind`` event would refresh the spec before the node is ready (its
    end reports itself); a driver changed by anyone else (`tpuboot unbind`) reports at once."""
    from tests.unit.helpers.daemon import Event
    from tpuboot.devices.manager import DeviceManager, DeviceState

    manager = DeviceManager(None, binder(kernel), None, None, None)  # type: ignore[arg-type]
    reports: list[None] = []
    manager.on_change = lambda: reports.append(None)
    manager.devices["0000:00:04.0"] = DeviceState("TPU v5p", state="pending", running=True)
    manager.dispatch(Event("bind", "pci", "0000:00:04.0"))
    assert reports == []
    manager.devices["0000:00:04.0"] = DeviceState("TPU v5p", state="bound")
    manager.dispatch(Event("unbind", "pci", "0000:00:04.0"))
    manager.dispatch(Event("unbind", "pci", "0000:00:09.0"))  # not ours
    assert reports == [None]
