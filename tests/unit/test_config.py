import pytest

from tpuboot.config import Config, load_config, parse_config
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
