"""The command line: exit codes, one-line errors, and nothing touched on bad input."""

from __future__ import annotations

import errno
import json
import socket

import pytest

from harness.mds_emulator import MetadataEmulator
from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import V5P, add_tpu
from tpuboot import cli
from tpuboot.devices import vfio


@pytest.fixture
def kernel(tmp_path):
    k = FakeKernel(tmp_path / "root")
    add_tpu(k, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    k.add_device("0000:00:02.0", 0x1AF4, 0x1001, driver="virtio-pci", group="2")
    return k


def run(kernel: FakeKernel, *argv: str) -> int:
    return cli.main(["--root", str(kernel.top), *argv])


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_malformed_address_is_a_usage_error_and_touches_nothing(kernel, capsys):
    before = kernel.override("0000:00:04.0")
    assert run(kernel, "bind", "0000:00:04.0", "00:04x0") == cli.EXIT_USAGE
    assert "write it as dddd:bb:dd.f" in one_line(capsys.readouterr().err)
    assert kernel.override("0000:00:04.0") == before  # the valid address was not bound either


def test_bind_refuses_the_boot_disk_without_force(kernel, capsys):
    assert run(kernel, "bind", "00:02.0") == cli.EXIT_FAILED
    err = one_line(capsys.readouterr().err)
    assert "not a TPU and is driven by virtio-pci" in err and "--force" in err
    assert kernel.driver("0000:00:02.0") == "virtio-pci"
    assert kernel.override("0000:00:02.0") == "(null)"


def test_unknown_command_is_a_usage_error(kernel, capsys):
    with pytest.raises(SystemExit) as info:
        run(kernel, "frobnicate")
    assert info.value.code == cli.EXIT_USAGE


@pytest.mark.parametrize(
    "argv", [["frobnicate"], ["bind"], ["status", "--jsn"], ["metadata"], ["--root", "/r", "--ro"]]
)
def test_a_usage_error_is_exit_status_2_with_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("usage: tpuboot")


def test_bad_config_fails_with_file_and_key(kernel, tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("vfio: {mode: 1}\n")
    assert cli.main(["--root", "/", "--config", str(config), "status"]) == cli.EXIT_FAILED
    assert f"{config}: vfio: unknown key 'mode'" in one_line(capsys.readouterr().err)


def test_status_json_reports_each_tpu(kernel, capsys):
    kernel.p("/dev/vfio/4").chmod(0o666)
    assert run(kernel, "status", "--json") == cli.EXIT_OK
    (tpu,) = json.loads(capsys.readouterr().out)
    assert tpu["address"] == "0000:00:04.0"
    assert (tpu["kind"], tpu["driver"], tpu["iommu_group"]) == ("TPU v5p", "vfio-pci", "4")
    assert (tpu["node"], tpu["node_mode"]) == ("/dev/vfio/4", "0666")
    assert (tpu["viable"], tpu["problem"]) == (True, None)
    assert (tpu["chip"], tpu["holders"]) == (0, [])


def test_status_json_names_each_chips_holders(kernel, capsys):
    """The holders `tpuboot who` finds, on each function of their chip: a training job holding
    the chip's /dev/vfio node open."""
    from tests.unit.fakes.proc import FakeProc

    kernel.p("/dev/vfio/4").chmod(0o666)
    FakeProc(kernel.top).add(4242, {5: "/dev/vfio/4"}, cmdline=["python3", "train.py"])
    assert run(kernel, "status", "--json") == cli.EXIT_OK
    (tpu,) = json.loads(capsys.readouterr().out)
    (holder,) = tpu["holders"]
    assert tpu["chip"] == 0 and holder["pid"] == 4242 and holder["nodes"] == ["/dev/vfio/4"]
    assert (holder["command"], holder["unit"]) == ("python3 train.py", "train.service")


def test_status_fails_when_a_tpu_is_not_usable(kernel, capsys):
    assert run(kernel, "status") == cli.EXIT_FAILED  # the node is still 0600
    assert "/dev/vfio/4 has mode 0600, not 0666" in capsys.readouterr().out


def test_status_says_first_how_vfio_pci_is_in_the_kernel(kernel, capsys):
    run(kernel, "status")
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("vfio-pci: ") and first.endswith("driver registered"), first


def test_metadata_get_prints_the_raw_value(emulator: MetadataEmulator, monkeypatch, capsys):
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    emulator.set_attribute("greeting", 'it\'s "quoted" $HOME\n')
    assert cli.main(["metadata", "get", "greeting"]) == cli.EXIT_OK
    assert capsys.readouterr().out == 'it\'s "quoted" $HOME\n'


def test_metadata_get_absent_key(emulator: MetadataEmulator, monkeypatch, capsys):
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    assert cli.main(["metadata", "get", "nope"]) == cli.EXIT_ABSENT
    assert "not set; pass --default" in one_line(capsys.readouterr().err)
    assert cli.main(["metadata", "get", "nope", "--default", "fallback"]) == cli.EXIT_OK
    assert capsys.readouterr().out == "fallback"


def test_env_writes_tpu_env_and_environment(emulator: MetadataEmulator, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GCE_METADATA_HOST", emulator.host)
    top = tmp_path / "root"
    (top / "etc").mkdir(parents=True)
    assert cli.main(["--root", str(top), "env"]) == cli.EXIT_OK
    said = capsys.readouterr()
    assert said.out == "" and said.err.endswith("\ntpuboot: tpu-env: 14 keys from metadata\n")
    assert cli.main(["--root", str(top), "env", "--print"]) == cli.EXIT_OK  # stdout: tpu-env alone
    assert capsys.readouterr().out == (top / "home/tpu-runtime/tpu-env").read_text()
    assert 'ACCELERATOR_TYPE="' in (top / "home/tpu-runtime/tpu-env").read_text()
    assert "CLOUDSDK_PYTHON=/usr/bin/python3" in (top / "etc/environment").read_text()


def test_one_shot_commands_say_an_unreachable_metadata_server_once(monkeypatch, tmp_path, capsys):
    """No "retrying with backoff" line from a command that has ended: its error names every kind
    of failure; env says its result once (no tpu-env written, no cache), after that error."""
    with socket.socket() as bound:  # bound, never listening: every connection to it is refused
        bound.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{bound.getsockname()[1]}"
        monkeypatch.setenv("GCE_METADATA_HOST", host)
        one_shot_commands_against(host, tmp_path, capsys)


def one_shot_commands_against(host: str, tmp_path, capsys) -> None:
    top = tmp_path / "root"
    (top / "etc").mkdir(parents=True)
    assert (
        cli.main(["--root", str(top), "metadata", "get", "tpu-env", "--deadline", "0.5"]) == cli.EXIT_FAILED
    )
    said = capsys.readouterr()
    assert said.out == ""
    assert one_line(said.err).startswith(
        f"tpuboot: metadata server http://{host}/computeMetadata/v1/: connection"
    )
    assert cli.main(["--root", str(top), "env", "--deadline", "0.5"]) == cli.EXIT_FAILED
    said = capsys.readouterr()
    lines = [line for line in said.err.splitlines() if not line.startswith("tpuboot: /etc/environment: set ")]
    assert said.out == "" and "retrying" not in said.err, said
    assert lines[0].startswith(f"tpuboot: tpu-env: metadata server http://{host}/") and "try" in lines[0]
    left = "left /home/tpu-runtime/tpu-env as it was"
    assert lines[1:] == [f"tpuboot: tpu-env: metadata server unreachable and no cached copy; {left}"]


@pytest.mark.parametrize("deadline", ["nan", "inf", "-1", "0", "1e9", "soon"])
def test_a_deadline_that_never_or_always_ends_is_a_usage_error(kernel, deadline, capsys):
    with pytest.raises(SystemExit) as exit_:
        run(kernel, "env", "--deadline", deadline)
    assert exit_.value.code == cli.EXIT_USAGE
    assert "not a number of seconds" in capsys.readouterr().err


def test_an_unexpected_error_binding_one_device_is_one_line_and_the_rest_go_on(kernel, monkeypatch, capsys):
    add_tpu(kernel, "0000:00:05.0", driver="vfio-pci", group="5")
    kernel.load_module("vfio_iommu_type1")
    real = vfio.Binder.bind

    def bind(self, address, **kwargs):
        if address == "0000:00:04.0":
            raise KeyError("boom")
        return real(self, address, **kwargs)

    monkeypatch.setattr(vfio.Binder, "bind", bind)
    assert run(kernel, "bind", "0000:00:04.0", "0000:00:05.0") == cli.EXIT_FAILED
    out, err = capsys.readouterr()
    assert "tpuboot: 0000:00:04.0: unexpected KeyError ('boom'); please report it\n" in err
    assert "Traceback" not in err
    assert "0000:00:05.0 (TPU v5p) already bound to vfio-pci" in out


def test_status_shows_a_device_whose_state_cannot_be_read(kernel, monkeypatch, capsys):
    kernel.faults.add("readlink", "0000:00:04.0/driver", errno.EIO)
    kernel.faults.install(monkeypatch)
    assert run(kernel, "status", "--json") == cli.EXIT_FAILED
    (tpu,) = json.loads(capsys.readouterr().out)
    assert tpu["address"] == "0000:00:04.0" and tpu["kind"] == "TPU v5p"
    assert "EIO" in tpu["problem"] and "\n" not in tpu["problem"]
