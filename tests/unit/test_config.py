import subprocess
import sys
from pathlib import Path

import pytest

from tpuboot.config import Config, EnvConfig, VfioConfig, load_config, parse_config
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

SOURCE = "/etc/tpuboot/tpuboot.yaml"


def test_empty_file_means_defaults():
    assert parse_config("", SOURCE) == Config()
    assert Config().vfio.node_mode == 0o666


def test_missing_default_file_means_defaults(tmp_path):
    assert load_config(Root(tmp_path)) == Config()


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(Root(tmp_path), "/etc/other.yaml")


def test_device_rules_accept_hex_ints_and_strings():
    config = parse_config("devices:\n- {vendor: 0x1234, device: '11e8', name: edu}\n", SOURCE)
    rule = config.devices[0]
    assert (rule.vendor, rule.device, rule.name) == (0x1234, 0x11E8, "edu")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vfio: {nodemode: '0600'}", "tpuboot.yaml: vfio: unknown key 'nodemode'"),
        ("colour: blue", "unknown key .colour. .known keys: devices, env, gke, metadata, metrics, "),
        ("devices: [{vendor: 0x1234}]", "devices.0.: vendor and device are both required"),
        ("devices: [{vendor: 0x1234, device: 1, subsystem_vendor: 1}]", "give both subsystem_vendor"),
        ("devices: [{vendor: 0x12345, device: 1}]", "not a 16-bit PCI id"),
        ("vfio: {node_mode: 666}", "write it quoted in octal"),
        ("vfio: {allow_unsafe_interrupts: maybe}", "not one of auto, true, false"),
        ("vfio: [1]", "vfio: expected a mapping"),
        ("devices: {a: 1}", "expected a list"),
        ("vfio: {node_mode: '0666'", "line 1 is not valid YAML"),
        ("env: {tpu_env_path: relative/path}", "not an absolute path"),
    ],
)
def test_bad_config_names_file_and_key(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text, SOURCE)
    assert str(info.value).startswith(SOURCE)
    assert "\n" not in str(info.value)


def test_yaml_booleans_map_to_choices():
    assert parse_config("vfio: {allow_unsafe_interrupts: no}", SOURCE).vfio.allow_unsafe_interrupts == "false"


def test_sections_are_frozen_records_equal_by_value():
    config = parse_config("vfio: {node_mode: '0600'}\n", SOURCE)
    assert config == Config(vfio=VfioConfig(node_mode=0o600))
    assert config != Config()
    assert hash(config.vfio) == hash(VfioConfig(node_mode=0o600))
    with pytest.raises(AttributeError, match="frozen"):
        config.vfio.node_mode = 0o644  # type: ignore[misc]
    assert config.vfio.replace(retries=1) == VfioConfig(node_mode=0o600, retries=1)
    assert repr(VfioConfig()).startswith("VfioConfig(node_mode=438, allow_unsafe_interrupts='auto'")
    with pytest.raises(TypeError, match="unexpected fields"):
        VfioConfig(nodemode=1)


def test_mutable_defaults_are_not_shared():
    first, second = EnvConfig(), EnvConfig()
    first.environment["EXTRA"] = "1"
    assert "EXTRA" not in second.environment


def test_a_file_of_comments_needs_no_yaml_parser():
    """The shipped file is all comments: `tpuboot bind` must not pay for importing yaml."""
    shipped = (Path(__file__).parents[2] / "conf/tpuboot.yaml").read_text()
    code = "import sys; from tpuboot.config import parse_config; parse_config(sys.stdin.read(), 'f'); "
    code += "print('yaml' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], input=shipped, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"
    assert parse_config("# only a comment\n\n   # another\nvfio: {retries: 2}\n", SOURCE).vfio.retries == 2


def test_bind_path_imports_nothing_it_does_not_need():
    """What `tpuboot bind` imports is its start-up time (about 20x slower on the TCG bench)."""
    heavy = ["yaml", "typing", "dataclasses", "subprocess", "json", "platform", "asyncio", "requests",
             "prometheus_client", "pyudev", "systemd", "tpuboot.status", "tpuboot.metrics"]  # fmt: skip
    code = f"import sys, tpuboot.cli; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.stdout.split() == []
