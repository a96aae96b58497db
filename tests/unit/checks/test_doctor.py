"""`tpuboot doctor` on a temporary tree: a healthy TPU VM passes every check; each broken setting
fails exactly its own check, with a fix; what cannot be judged is SKIP with the reason."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.unit.fakes.dockerd import fake_dockerd
from tests.unit.fakes.kernel import FakeKernel, VfioShape
from tests.unit.helpers.devices import V5P, add_tpu
from tests.unit.helpers.images import GOOD_CMDLINE, MANAGER_GOOD, PAM_GOOD, NoSystemctl, write
from tests.unit.helpers.metadata import make_config
from tpuboot import cli
from tpuboot.checks import image as imagecheck
from tpuboot.checks.containers import engine_container_state
from tpuboot.checks.doctor import Doctor, Verdict
from tpuboot.config import Config, EnvConfig, TelemetryConfig, VbarConfig, VfioConfig
from tpuboot.containers import cdi, cdi_file
from tpuboot.containers.engine import EngineUnreachable as Unreachable
from tpuboot.devices.table import DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.env.identity import PRODUCT_UUID_PATH
from tpuboot.env.tpuenv import parse_env_file, render_env_file
from tpuboot.errors import MetadataError
from tpuboot.gce.replies import MetadataAbsent, Reply
from tpuboot.paths import Root

REPO = Path(__file__).resolve().parents[3]
TPU_ENV = {
    "ACCELERATOR_TYPE": "v5p-8",
    "TOPOLOGY": "2x2x1",
    "CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "HOST_BOUNDS": "1,1,1",
    "WORKER_ID": "0",
    "ZONE": "us-east5-a",
    "ODD": 'a"b$c`d\\e\nf',
}
ADDRESSES = [f"0000:00:0{4 + i}.0" for i in range(4)]
UUID = "0c5f2b8e-61d4-4f0a-b3c7-9e2a1d8f4b60"  # the instance's SMBIOS system UUID


def healthy(top: Path, vfio: VfioShape = "module") -> FakeKernel:
    """A TPU VM as it should be: 4 v5p bound, nodes 0666, the image settings, tpu-env and its cache;
    vfio-pci loaded as a module (Debian) or built into the kernel (Ubuntu)."""
    k = FakeKernel(top, vfio)
    k.load_module("vfio-pci")  # what tpuboot's bind did: a module loads, a built-in stays as it is
    write(top, "/sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts", "Y\n")
    for i, address in enumerate(ADDRESSES):
        add_tpu(k, address, V5P, driver="vfio-pci", group=str(4 + i))
        os.chmod(k.p(f"/dev/vfio/{4 + i}"), 0o666)
    k.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    write(top, "/proc/cmdline", GOOD_CMDLINE)
    write(top, "/proc/sys/kernel/arch", "x86_64\n")
    write(top, "/proc/stat", f"cpu 1 2 3\nbtime {int(time.time()) - 3600}\n")
    write(top, "/sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n")
    write(top, "/etc/security/limits.d/tpuboot.conf", PAM_GOOD)
    write(top, "/usr/lib/systemd/system.conf.d/50-tpuboot.conf", MANAGER_GOOD)
    write(top, "/lib/udev/rules.d/70-tpuboot.rules", 'KERNEL=="accel*", MODE="0666"\n')
    env = EnvConfig()
    set_tpu_env(top, TPU_ENV)
    binder = Binder(k.root, DeviceTable(), VfioConfig())
    cdi_file.apply(k.root, cdi.host_spec(k.root, make_config(), binder))  # the daemon's, with tpu-env
    write(top, env.environment_path, "".join(f'{k}="{v}"\n' for k, v in env.environment.items()))
    return k


def set_tpu_env(top: Path, values: dict[str, str]) -> None:
    """tpu-env as tpuboot writes it from metadata: the file and its cache record agree."""
    env = EnvConfig()
    write(top, env.tpu_env_path, render_env_file(values))
    fetched = "2026-11-29T20:00:00+00:00"
    record = {
        "format": 2,
        "product_uuid": UUID,
        "fetched": fetched,
        "etag": "e1",
        "tpu_env": json.dumps(values),
    }
    write(top, f"{env.cache_dir}/tpu-env.json", json.dumps(record))
    write(top, PRODUCT_UUID_PATH, UUID.upper() + "\n")  # this instance wrote the record


@pytest.fixture(params=["module", "builtin"])
def kernel(tmp_path: Path, request: pytest.FixtureRequest) -> FakeKernel:
    """Every doctor test runs on Debian's modular vfio-pci and on Ubuntu's built-in one."""
    return healthy(tmp_path / "root", request.param)


class Values:
    """A metadata server holding ``values`` (path: text); every other key is absent (404)."""

    def __init__(self, values: dict[str, str] | None = None) -> None:
        self.values = values or {}

    def get(self, path: str, *, deadline_s: float) -> Reply:
        if path not in self.values:
            raise MetadataAbsent(f"{path}: no such metadata key")
        return Reply(self.values[path].encode(), None)


class Silent:
    """A metadata server that does not answer."""

    def get(self, path: str, *, deadline_s: float) -> Reply:
        raise MetadataError("169.254.169.254: connection refused")


def doctor(kernel: FakeKernel, config: Config | None = None, **kwargs) -> list[Verdict]:
    kwargs.setdefault("container_state", lambda root, name: "running")
    kwargs.setdefault("endpoint_probe", lambda endpoint, root: None)  # vBar answers
    kwargs.setdefault("metadata", Values())  # a metadata server that has none of the keys
    kwargs.setdefault("systemd", NoSystemctl())
    return Doctor(kernel.root, config or make_config(), **kwargs).run()


def statuses(verdicts: list[Verdict]) -> dict[str, str]:
    return {v.result.name: v.result.status for v in verdicts}


def failing(verdicts: list[Verdict]) -> list[str]:
    return [v.result.name for v in verdicts if v.result.status == "FAIL"]


def test_a_healthy_vm_passes_every_check(kernel):
    verdicts = doctor(kernel)
    found = statuses(verdicts)
    assert failing(verdicts) == [], [v.result for v in verdicts if v.result.status == "FAIL"]
    # The container runtimes are not installed in this tree: their limits are SKIP; the
    # telemetry collector is off by default; no engine, job unit or chip holder runs (memlock).
    skips = {n for n, s in found.items() if s == "SKIP"}
    container_checks = {"cdi-docker", "cdi-podman", "cdi-containerd", "container-memlock", "vbar-relay"}
    unwatched = {"maintenance-notice"}  # no daemon wrote /run/tpuboot/notice here
    unwatched |= {"runtime-metrics", "libtpu-hang", "libtpu-slice-error"}  # nor /run/tpuboot/runtime
    assert skips == {
        "docker-limits",
        "containerd-limits",
        "telemetry-running",
        "memlock",
        "slice-identity",  # a single host: no worker list
        *container_checks,
        *unwatched,
    }
    for name in (
        *imagecheck.IMAGE_CHECKS.names,
        "tpus-bound",
        "vfio-node-mode",
        "chip-count",
        "slice",
        "vbar-running",
    ):
        assert name in found
    assert next(v for v in verdicts if v.result.name == "chip-count").result.detail == (
        "4 chips usable, as CHIPS_PER_HOST_BOUNDS 2,2,1 implies"
    )
    assert next(v for v in verdicts if v.result.name == "slice").result.detail == (
        "v5p-8, 4 chips in 2x2x1, 1 host of 4 chips, this host is worker 0"
    )


BREAKAGES = {
    "tpus-bound": lambda k: k.write(k.p("/sys/bus/pci/devices/0000:00:05.0/driver/unbind"), "0000:00:05.0"),
    "vfio-node-mode": lambda k: os.chmod(k.p("/dev/vfio/6"), 0o600),
    "vfio-pci-loaded": lambda k: k.unload_module("vfio-pci"),
    "unsafe-interrupts": lambda k: k.p(imagecheck_unsafe()).write_text("N\n"),
    "pam-memlock": lambda k: k.p("/etc/security/limits.d/tpuboot.conf").write_text(
        "* - nofile 100000\nroot - nofile 100000\n"
    ),
    "cmdline-idle-poll": lambda k: k.p("/proc/cmdline").write_text(GOOD_CMDLINE.replace(" idle=poll", "")),
    "accel-udev-rule": lambda k: k.p("/lib/udev/rules.d/70-tpuboot.rules").unlink(),
    "tpu-env-fresh": lambda k: k.p(EnvConfig().tpu_env_path).write_text(render_env_file({"ZONE": "old"})),
    "environment": lambda k: k.p("/etc/environment").write_text("PATH=/usr/bin\n"),
    "cdi-spec": lambda k: k.p(cdi.SPEC_PATH).unlink(),
}


def imagecheck_unsafe() -> str:
    from tpuboot.checks.doctor import UNSAFE_INTERRUPTS

    return UNSAFE_INTERRUPTS


def result_of(verdicts: list[Verdict], name: str):
    (found,) = [v.result for v in verdicts if v.result.name == name]
    return found


def test_vfio_pci_check_on_each_kernel(kernel):
    """Debian: a module, in /proc/modules. Ubuntu: built in, never in /proc/modules (lsmod shows
    nothing), and still a PASS, said as such; image-check's view agrees."""
    verdicts = doctor(kernel)
    loaded, image = result_of(verdicts, "vfio-pci-loaded"), result_of(verdicts, "vfio-pci-in-kernel")
    assert (loaded.status, image.status) == ("PASS", "PASS")
    if kernel.vfio == "builtin":
        assert "vfio_pci" not in kernel.loaded()
        assert loaded.detail == (
            "vfio-pci is built into kernel 6.8.0-1015-gcp (/lib/modules/6.8.0-1015-gcp/modules.builtin); "
            "lsmod does not list it"
        )
        assert image.detail.startswith("vfio-pci built into 6.8.0-1015-gcp")
    else:
        assert "vfio_pci" in kernel.loaded()
        assert loaded.detail == "vfio_pci is loaded as a module (/proc/modules)"
        assert image.detail.startswith("vfio-pci loaded in 6.1.0-28-cloud-amd64")


def test_built_in_vfio_pci_passes_without_its_sys_module_directory(tmp_path):
    """/sys/module/vfio_pci exists for a built-in only because it has parameters (sysfs-module ABI:
    "not by design and may be removed"): the verdict must not rest on it."""
    k = healthy(tmp_path / "root", "builtin")
    os.unlink(k.p("/sys/bus/pci/drivers/vfio-pci/module"))
    _rmtree(k.p("/sys/module/vfio_pci"))
    assert statuses(doctor(k))["vfio-pci-loaded"] == "PASS"


def test_a_kernel_without_vfio_pci_fails_and_names_the_fix(tmp_path):
    k = FakeKernel(tmp_path / "root", "none")
    k.p("/sys/module").mkdir(parents=True, exist_ok=True)
    add_tpu(k, ADDRESSES[0], V5P, group="4")
    verdicts = doctor(k)
    loaded, image = result_of(verdicts, "vfio-pci-loaded"), result_of(verdicts, "vfio-pci-in-kernel")
    assert (loaded.status, image.status) == ("FAIL", "FAIL")
    assert loaded.detail.startswith("kernel 6.1.0-28-cloud-amd64 has no vfio-pci: neither ")
    assert "CONFIG_VFIO_PCI" in loaded.fix and "\n" not in loaded.fix
    assert "CONFIG_VFIO_PCI" in image.fix


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


@pytest.mark.parametrize("check", sorted(BREAKAGES))
def test_each_broken_setting_fails_exactly_its_check_with_a_fix(kernel, check):
    if check == "vfio-pci-loaded" and kernel.vfio == "builtin":
        pytest.skip("a built-in vfio-pci cannot be unloaded: test_vfio_pci_check_on_each_kernel")
    BREAKAGES[check](kernel)
    verdicts = doctor(kernel)
    # An unbound TPU is also one bound chip fewer than the accelerator type implies, and one
    # device fewer than the CDI spec (which the daemon, not running here, would have rewritten).
    expected = [check, "chip-count", "cdi-spec"] if check in ("tpus-bound",) else [check]
    assert failing(verdicts) == expected, [v.result for v in verdicts if v.result.status == "FAIL"]
    bad = next(v for v in verdicts if v.result.name == check)
    assert bad.result.fix and "\n" not in bad.result.fix
    assert bad.required == (check != "tpu-env-fresh")


def test_a_missing_chip_fails_the_count(kernel):
    kernel.remove_device("0000:00:07.0")
    assert failing(doctor(kernel)) == ["chip-count", "cdi-spec"]  # the spec: no daemon here to update it


def test_machine_type_from_metadata_wins_over_tpu_env(kernel):
    machine = "projects/1/machineTypes/ct5lp-hightpu-8t"
    verdicts = doctor(kernel, metadata=Values({"instance/machine-type": machine}))
    (count,) = [v.result for v in verdicts if v.result.name == "chip-count"]
    assert count.status == "FAIL" and "machine type ct5lp-hightpu-8t implies 8" in count.detail


def test_unknown_generation_is_a_warning_and_no_chip_count(kernel):
    set_tpu_env(kernel.top, {"ACCELERATOR_TYPE": "v9-huge"})
    verdicts = doctor(kernel)
    assert statuses(verdicts)["chip-count"] == "SKIP"
    warning = result_of(verdicts, "slice")
    assert warning.status == "WARN"
    assert "'v9-huge' is not a generation in tpuboot's TPU table" in warning.detail
    assert "v5litepod/v5e" in warning.detail and "tpu7x" in warning.detail
    assert failing(verdicts) == []


def test_vbar_skips_on_gke_or_when_off_and_fails_when_it_does_not_run(kernel):
    def vbar(**kwargs) -> tuple[str, str]:
        v = result_of(doctor(kernel, **kwargs), "vbar-running")
        return v.status, v.detail

    gke = {"instance/attributes/cluster-name": "c1"}
    assert vbar(metadata=Values(gke)) == (
        "SKIP",
        "a GKE node (instance attribute cluster-name is set): GKE runs vBar (its device plugin)",
    )
    assert vbar(config=Config(gke="true"))[0] == "SKIP"
    assert vbar(config=Config(vbar=VbarConfig(enabled=False))) == (
        "SKIP",
        "vbar.enabled is false in the configuration",
    )
    assert vbar(container_state=lambda root, name: "absent")[0] == "FAIL"
    assert vbar(container_state=lambda root, name: "exited (exit code 1)") == (
        "FAIL",
        "container tpuboot-vbar-control-agent is exited (exit code 1)",
    )
    assert vbar() == ("PASS", "container tpuboot-vbar-control-agent is running")


def test_vbar_endpoint_is_checked_while_it_runs(kernel):
    def endpoint(**kwargs) -> tuple[str, str, str | None]:
        v = result_of(doctor(kernel, **kwargs), "vbar-endpoint")
        return v.status, v.detail, v.fix

    assert endpoint()[:2] == ("PASS", "vBar accepts connections at 127.0.0.1:8353")
    refused = endpoint(endpoint_probe=lambda e, root: "connection refused")
    assert refused[:2] == ("FAIL", "vBar runs but does not answer at 127.0.0.1:8353 (connection refused)")
    assert "docker logs tpuboot-vbar-control-agent" in (refused[2] or "")
    assert "vbar.endpoint" in (refused[2] or "") and "vbar.restart_unanswered_after" in (refused[2] or "")
    exited = endpoint(container_state=lambda root, name: "exited (exit code 1)")
    assert exited[:2] == (
        "SKIP",
        "container tpuboot-vbar-control-agent is exited (exit code 1): vbar-running says why",
    )
    assert endpoint(config=Config(vbar=VbarConfig(endpoint=None)))[:2] == (
        "SKIP",
        "vbar.endpoint is empty: not checked",
    )
    assert endpoint(config=Config(vbar=VbarConfig(enabled=False)))[0] == "SKIP"
    assert endpoint(metadata=Values({"instance/attributes/cluster-name": "c1"}))[0] == "SKIP"  # GKE's
    exec_config = Config(vbar=VbarConfig(runtime="exec"))
    child = endpoint(config=exec_config, endpoint_probe=lambda e, r: "no such socket")
    assert child[0] == "FAIL" and "journalctl -u tpuboot AGENT=vBar" in (child[2] or "")


def test_tpu_env_missing_or_garbled(kernel):
    path = kernel.p(EnvConfig().tpu_env_path)
    path.write_text("export A=$(reboot)\n")
    assert failing(doctor(kernel)) == ["tpu-env", "tpu-env-fresh"]
    path.unlink()
    assert failing(doctor(kernel)) == ["tpu-env"]


def test_tpu_env_without_cache_record_is_judged_by_the_boot_time(kernel):
    kernel.p(f"{EnvConfig().cache_dir}/tpu-env.json").unlink()
    assert statuses(doctor(kernel))["tpu-env-fresh"] == "PASS"
    old = time.time() - 7200
    os.utime(kernel.p(EnvConfig().tpu_env_path), (old, old))
    assert failing(doctor(kernel)) == ["tpu-env-fresh"]


def test_env_file_parser_round_trips_what_tpuboot_writes():
    assert parse_env_file(render_env_file(TPU_ENV)) == TPU_ENV
    assert parse_env_file("A=1\n") is None


def test_cli_lines_json_and_exit_status(kernel, capsys):
    top = str(kernel.top)
    assert cli.main(["--root", top, "doctor"]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert all(line.split()[0] in ("PASS", "FAIL", "SKIP") for line in lines)
    assert len(lines) == len(doctor(kernel))
    os.chmod(kernel.p("/dev/vfio/4"), 0o600)
    assert cli.main(["--root", top, "doctor", "--json"]) == cli.EXIT_FAILED
    report = json.loads(capsys.readouterr().out)
    (bad,) = [r for r in report if r["status"] == "FAIL"]
    assert bad["name"] == "vfio-node-mode" and bad["required"] and "chmod 666 /dev/vfio/4" in bad["fix"]
    # An advisory failure alone does not fail the doctor.
    os.chmod(kernel.p("/dev/vfio/4"), 0o666)
    kernel.p(EnvConfig().tpu_env_path).write_text(render_env_file({"ZONE": "old"}))
    assert cli.main(["--root", top, "doctor"]) == cli.EXIT_OK
    assert "FAIL  tpu-env-fresh (advisory): " in capsys.readouterr().out


def test_metadata_lookup_reads_the_machine_type_and_gives_up_once_on_a_silent_server(caplog):
    from harness.mds_emulator import MetadataEmulator
    from tpuboot.checks.doctor import METADATA_DEADLINE, AskedOnce, metadata_lookup
    from tpuboot.config import MetadataConfig

    machine = "projects/1/machineTypes/ct5p-hightpu-4t"
    with MetadataEmulator({}, instance={"machine-type": machine}) as emu:
        lookup = AskedOnce(metadata_lookup(MetadataConfig(host=emu.host, timeout=1.0)), METADATA_DEADLINE)
        assert lookup.get("instance/machine-type", deadline_s=60).text == machine
        with pytest.raises(MetadataAbsent):
            lookup.get("instance/attributes/cluster-name", deadline_s=60)
        assert lookup.down is None
        emu.stop()
        started = time.monotonic()
        with pytest.raises(MetadataError) as first:
            lookup.get("instance/machine-type", deadline_s=60)
        assert f"in {METADATA_DEADLINE:g} s)" in str(first.value)  # asked within doctor's deadline, not 60 s
        with pytest.raises(MetadataError) as second:
            lookup.get("instance/attributes/kube-env", deadline_s=60)
        assert second.value is first.value  # not asked again: no second wait
        # Only a hang passes this bound (10x the deadline), not a loaded machine; the two lines
        # above prove the deadline.
        assert time.monotonic() - started < 10 * METADATA_DEADLINE
    assert "retrying" not in caplog.text


def test_an_admins_own_value_passes_and_is_named(kernel):
    """tpuboot keeps an admin's value (tpuboot/env/etc_environment.py); doctor says which it kept."""
    env = make_config().env
    key = sorted(env.environment)[0]
    lines = [f'{k}="{"900" if k == key else v}"\n' for k, v in env.environment.items()]
    kernel.p(env.environment_path).write_text("".join(lines))
    (check,) = [v.result for v in doctor(kernel) if v.result.name == "environment"]
    assert check.status == "PASS"
    assert f"; {key}='900' kept as the admin set it (tpuboot's: {env.environment[key]!r})" in check.detail


# --- slices ------------------------------------------------------------------------------------------


def test_a_worker_of_a_multi_host_slice_expects_its_own_four_chips(kernel):
    """v5p-1024: 512 chips on 128 hosts; this one is worker 5 and must have 4, not 512."""
    set_tpu_env(
        kernel.top,
        {
            "ACCELERATOR_TYPE": "v5p-1024",
            "TOPOLOGY": "8x8x8",
            "CHIPS_PER_HOST_BOUNDS": "2,2,1",
            "HOST_BOUNDS": "4,4,8",
            "WORKER_ID": "5",
        },
    )
    endpoints = ",".join(f"w-{i}:{i}:127.10.{i // 200}.{i % 200 + 1}" for i in range(128))
    verdicts = doctor(kernel, metadata=slice_metadata("5", endpoints, own="127.10.0.6"))
    assert failing(verdicts) == []
    assert result_of(verdicts, "chip-count").detail == (
        "4 chips usable, as CHIPS_PER_HOST_BOUNDS 2,2,1 implies (128 hosts of 4 chips)"
    )
    assert result_of(verdicts, "slice").detail == (
        "v5p-1024, 512 chips in 8x8x8, 128 hosts of 4 chips, this host is worker 5"
    )
    kernel.remove_device(ADDRESSES[3])
    assert result_of(doctor(kernel), "chip-count").detail.startswith("3 chips usable (3 present), ")


def test_a_slice_that_contradicts_itself_fails_with_the_fix(kernel, capsys):
    set_tpu_env(kernel.top, {**TPU_ENV, "WORKER_ID": "4"})
    verdicts = doctor(kernel)
    assert failing(verdicts) == ["slice", "slice-identity"]  # worker 4 of a 1-host slice, both say
    bad = result_of(verdicts, "slice")
    assert bad.detail == "WORKER_ID 4 is outside the slice: its 1 host is worker 0"
    assert bad.fix.startswith("correct the tpu-env instance attribute") and "tpuboot env" in bad.fix
    assert cli.main(["--root", str(kernel.top), "doctor"]) == cli.EXIT_FAILED
    assert "FAIL  slice: WORKER_ID 4 is outside the slice" in capsys.readouterr().out


def test_chips_of_another_generation_fail_the_count(kernel):
    """Four v5p chips where tpu-env and the machine type say v6e: this is not the VM they describe."""
    set_tpu_env(kernel.top, {"ACCELERATOR_TYPE": "v6e-4", "WORKER_ID": "0"})
    machine = {"instance/machine-type": "projects/1/machineTypes/ct6e-standard-4t"}
    verdicts = doctor(kernel, metadata=Values(machine))
    assert failing(verdicts) == ["chip-count"]
    count = result_of(verdicts, "chip-count")
    assert count.detail == "TPU v5p present; accelerator type v6e-4 is TPU v6e"
    assert "recreate the VM" in count.fix


def test_an_unknown_generation_warns_in_the_cli_and_fails_nothing(kernel, capsys):
    set_tpu_env(kernel.top, {"ACCELERATOR_TYPE": "tpu9z-8"})
    assert cli.main(["--root", str(kernel.top), "doctor"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "WARN  slice: accelerator type 'tpu9z-8' is not a generation in tpuboot's TPU table" in out
    assert cli.main(["--root", str(kernel.top), "doctor", "--json"]) == cli.EXIT_OK
    report = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert report["slice"]["status"] == "WARN" and report["slice"]["required"]


# --- vBar, the telemetry collector and dockerd ------------------------------------------------------


def test_vbar_needed_without_dockerd_fails_with_the_fix(kernel):
    """Not a GKE node, vBar on, no docker socket: a FAIL naming how to get dockerd, not a SKIP."""
    verdicts = doctor(kernel, container_state=engine_container_state)
    vbar = result_of(verdicts, "vbar-running")
    assert vbar.status == "FAIL"
    assert vbar.detail == "dockerd does not answer (no socket /run/docker.sock): vBar cannot run"
    assert vbar.fix == "apt install docker.io (then systemctl restart tpuboot)"
    write(kernel.top, "/usr/sbin/dockerd", "")  # installed, not running
    vbar = result_of(doctor(kernel, container_state=engine_container_state), "vbar-running")
    assert vbar.fix.startswith("systemctl enable --now docker")


def test_metadata_that_does_not_answer_cannot_tell_gke_and_skips_the_agents(kernel):
    config = Config(telemetry=TelemetryConfig(enabled=True))
    verdicts = doctor(kernel, config, metadata=Silent(), container_state=engine_container_state)
    for name in ("vbar-running", "telemetry-running"):
        skip = result_of(verdicts, name)
        assert skip.status == "SKIP" and skip.detail.startswith("cannot tell whether this is a GKE node: ")
        assert skip.detail.endswith("; set gke: true or false")
    assert statuses(verdicts)["chip-count"] == "PASS"  # tpu-env still says it


@pytest.fixture
def dockerd():
    with fake_dockerd() as fake:
        yield fake


def test_container_state_as_dockerd_reports_it(dockerd):
    root = Root(dockerd.root)
    dockerd.add_container("running", "example.invalid/a:1")
    dockerd.add_container("stopped", "example.invalid/a:1")
    dockerd.die("stopped", 137)
    assert engine_container_state(root, "running") == "running"
    assert engine_container_state(root, "stopped") == "exited (exit code 137)"
    assert engine_container_state(root, "missing") == "absent"
    dockerd.stop()
    with pytest.raises(Unreachable):
        engine_container_state(root, "running")


def test_the_telemetry_collector_when_enabled(kernel, dockerd):
    """Checked like vBar against a dockerd: running, gone, stopped; off or on GKE, not checked."""
    telemetry = TelemetryConfig(enabled=True)
    config = Config(telemetry=telemetry)

    def in_dockerd(root: Root, name: str) -> str:  # the fake's socket is not under the kernel's tree
        return engine_container_state(Root(dockerd.root), name)

    def check(**kwargs):
        verdicts = doctor(kernel, kwargs.pop("config", config), container_state=in_dockerd, **kwargs)
        return result_of(verdicts, "telemetry-running")

    dockerd.add_container(telemetry.container_name, telemetry.image)
    dockerd.add_container(VbarConfig().container_name, "example.invalid/vbar:1")
    assert (check().status, check().detail) == ("PASS", f"container {telemetry.container_name} is running")
    dockerd.die(telemetry.container_name, 2)
    stopped = check()
    assert (stopped.status, stopped.detail) == (
        "FAIL",
        f"container {telemetry.container_name} is exited (exit code 2)",
    )
    assert "journalctl -u tpuboot AGENT=telemetry" in stopped.fix
    del dockerd.containers[telemetry.container_name]
    assert check().detail == f"container {telemetry.container_name} does not exist"
    assert check(config=Config()).detail == "telemetry.enabled is false in the configuration"
    gke = {"instance/attributes/kube-env": "x"}
    assert check(metadata=Values(gke)).detail == (
        "a GKE node (instance attribute kube-env is set): GKE runs the telemetry collector"
    )


def test_without_tpu_env_or_metadata_the_slice_says_why_it_is_not_judged(kernel):
    kernel.p(EnvConfig().tpu_env_path).unlink()
    verdicts = Doctor(kernel.root, make_config(), container_state=lambda root, name: "running").run()
    for name in ("chip-count", "slice"):
        assert result_of(verdicts, name).detail == (
            "no TPU machine type (no answer from the metadata server, see the metadata-server check) "
            "and no accelerator type in tpu-env"
        )


def test_a_cache_record_of_another_instance_fails_freshness_with_the_reason(kernel):
    kernel.p(PRODUCT_UUID_PATH).write_text("0f0e0d0c-0b0a-4908-8706-050403020100\n")  # a clone of the VM
    verdicts = doctor(kernel)
    assert failing(verdicts) == ["tpu-env-fresh"]
    fresh = next(v.result for v in verdicts if v.result.name == "tpu-env-fresh")
    assert f"belongs to another instance (system UUID {UUID}, this one is 0f0e0d0c-" in fresh.detail
    assert fresh.fix


def test_doctor_asks_the_image_checks_systemd_it_was_given(kernel):
    """On the host, systemctl's answer (what is in force) wins over the files: doctor passes its
    systemd to the image checks."""
    from tests.unit.helpers.images import Answering

    low = {"DefaultLimitMEMLOCK": "65536", "DefaultLimitMEMLOCKSoft": "65536"}
    systemd = Answering({None: low})
    verdicts = doctor(kernel, systemd=systemd)
    assert result_of(verdicts, "systemd-default-limits").status == "FAIL"
    assert None in systemd.asked
    assert result_of(doctor(kernel), "systemd-default-limits").status == "PASS"  # the files say so


def test_the_chip_count_counts_chips_not_functions(tmp_path):
    """A TPU7x chip is two PCI functions: 8 functions of a tpu7x-standard-4t VM are its 4 chips."""
    from tests.unit.helpers.devices import TPU7X, add_chips

    kernel = healthy(tmp_path / "root")
    for address in ADDRESSES:
        kernel.remove_device(address)
    add_chips(kernel, [str(20 + n) for n in range(8)], TPU7X, per_chip=2)
    machine = {"instance/machine-type": "projects/1/machineTypes/tpu7x-standard-4t"}
    set_tpu_env(tmp_path / "root", {"ACCELERATOR_TYPE": "tpu7x-8", "TOPOLOGY": "2x2x1", "WORKER_ID": "0"})
    count = result_of(doctor(kernel, metadata=Values(machine)), "chip-count")
    assert count.status == "PASS"
    assert count.detail == "4 chips usable, as machine type tpu7x-standard-4t implies"
    kernel.remove_device("0000:00:07.1")  # half of chip 3: the chip is not usable
    count = result_of(doctor(kernel, metadata=Values(machine)), "chip-count")
    assert count.status == "FAIL" and count.detail.startswith("3 chips usable (4 present, 7 PCI functions)")


def test_pcie_health_fails_a_degraded_link_or_a_lost_function_and_warns_on_nonfatal_errors(kernel):
    assert result_of(doctor(kernel), "pcie-health").status == "PASS"
    device = kernel.p(f"/sys/bus/pci/devices/{ADDRESSES[1]}")
    (device / "aer_dev_nonfatal").write_text("CmpltTO 1\nTOTAL_ERR_NONFATAL 1\n")
    result = result_of(doctor(kernel), "pcie-health")
    assert (result.status, result.detail) == (
        "WARN",
        f"{ADDRESSES[1]} logged 1 non-fatal PCIe error(s) since boot",
    )
    for name, text in [("current_link_width", "8"), ("max_link_width", "16")]:
        (device / name).write_text(text + "\n")
    for name in ("current_link_speed", "max_link_speed"):
        (device / name).write_text("32.0 GT/s PCIe\n")
    result = result_of(doctor(kernel), "pcie-health")
    assert result.status == "FAIL" and "link trained at 32 GT/s x8 of 32 GT/s x16 (50% of" in result.detail
    assert result.fix
    (kernel.p(f"/sys/bus/pci/devices/{ADDRESSES[2]}") / "config").write_bytes(b"\xff" * 64)
    result = result_of(doctor(kernel), "pcie-health")
    assert f"{ADDRESSES[2]} does not answer config reads (vendor id 0xffff)" in result.detail


def test_an_unreachable_metadata_server_is_said_once_in_its_own_check(kernel, caplog):
    """The metadata-server check says why, once; chip-count, slice and the agents' checks name it
    instead of repeating its text, and nothing logs a retry."""
    from tpuboot.checks.doctor import metadata_lookup
    from tpuboot.config import MetadataConfig

    kernel.p(EnvConfig().tpu_env_path).unlink()
    with socket.socket() as bound:  # bound, never listening: every connection to it is refused
        bound.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{bound.getsockname()[1]}"
        client = metadata_lookup(MetadataConfig(host=host, timeout=0.2))
        verdicts = doctor(kernel, metadata=client, metadata_deadline=0.5)
    server = result_of(verdicts, "metadata-server")
    assert server.status == "FAIL"
    assert server.detail.startswith(
        f"metadata server unreachable: http://{host}/computeMetadata/v1/: connection"
    )
    assert server.fix == "check the VM's network, or metadata.host / $GCE_METADATA_HOST"
    said = [
        result_of(verdicts, name).detail for name in ("chip-count", "slice", "vbar-running", "vbar-endpoint")
    ]
    assert all("see the metadata-server check" in detail and host not in detail for detail in said), said
    assert sum(host in v.result.detail for v in verdicts) == 1
    assert "retrying" not in caplog.text


def test_the_metadata_server_check_passes_on_an_answer_and_skips_under_root(kernel):
    machine = "projects/1/machineTypes/ct5p-hightpu-4t"
    answered = result_of(
        doctor(kernel, metadata=Values({"instance/machine-type": machine})), "metadata-server"
    )
    assert (answered.status, answered.detail) == ("PASS", "answers (machine type ct5p-hightpu-4t)")
    assert result_of(doctor(kernel), "metadata-server").detail == "answers (machine type not set)"  # a 404
    tree = Doctor(kernel.root, make_config(), systemd=NoSystemctl(), container_state=lambda r, n: "running")
    skipped = result_of(tree.run(), "metadata-server")
    assert (skipped.status, skipped.detail) == ("SKIP", "not asked: --root names another tree, not this host")


SLICE_OF_TWO = {
    "ACCELERATOR_TYPE": "v5p-16",
    "TOPOLOGY": "2x2x2",
    "CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "HOST_BOUNDS": "1,1,2",
    "WORKER_ID": "1",
}


def slice_metadata(number: str, endpoints: str, own: str = "127.10.0.12") -> Values:
    return Values(
        {
            "instance/attributes/agent-worker-number": number,
            "instance/attributes/worker-network-endpoints": endpoints,
            "instance/network-interfaces/0/ip": own,
        }
    )


def test_slice_identity_skips_a_single_host_and_a_silent_server(kernel):
    single = result_of(doctor(kernel), "slice-identity")
    assert (single.status, single.detail) == (
        "SKIP",
        "a single host: no worker list to judge (this host is worker 0 of 1)",
    )
    silent = result_of(doctor(kernel, metadata=Silent()), "slice-identity")
    assert silent.status == "SKIP" and "see the metadata-server check" in silent.detail


def test_slice_identity_passes_a_worker_at_its_place(kernel):
    set_tpu_env(kernel.top, SLICE_OF_TWO)
    metadata = slice_metadata("1", "w-0:0:127.10.0.11,w-1:1:127.10.0.12")
    found = result_of(doctor(kernel, metadata=metadata), "slice-identity")
    assert (found.status, found.detail) == (
        "PASS",
        "worker-id: this host is worker 1 of 2; worker-list: worker-network-endpoints: 2 workers, no "
        "duplicate; own-address: 127.10.0.12 stands at index 1",
    )


@pytest.mark.parametrize(
    ("number", "endpoints", "own", "said"),
    [
        ("", "w-0:0:127.10.0.11,w-1:1:127.10.0.12", "127.10.0.12", "worker-id: agent-worker-number is blank"),
        ("1", "w-0:0:127.10.0.11", "127.10.0.12", "worker-list: worker-network-endpoints has 1 workers"),
        ("1", "w-0:0:127.10.0.12,w-1:1:127.10.0.11", "127.10.0.12", "own-address: this host is 127.10.0.12"),
        ("1", "w-0:0:127.10.0.11,w-1:1:127.10.0.11", "127.10.0.12", "worker-list: worker-network-end"),
    ],
)
def test_slice_identity_fails_each_wrong_identity_with_a_fix(kernel, number, endpoints, own, said):
    set_tpu_env(kernel.top, SLICE_OF_TWO)
    verdicts = doctor(kernel, metadata=slice_metadata(number, endpoints, own))
    found = result_of(verdicts, "slice-identity")
    assert found.status == "FAIL" and found.detail.startswith(said), found
    assert found.fix.startswith("recreate")
    assert "slice-identity" in failing(verdicts)
