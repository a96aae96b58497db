import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tpuboot.config import (
    Config,
    EnvConfig,
    MatchRule,
    TriState,
    VfioConfig,
    decided,
    load_config,
    parse_config,
)
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
        ("colour: blue", "unknown key .colour. .known keys: devices, "),
        ("devices: [{vendor: 0x1234}]", "devices.0.: vendor and device are required"),
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
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'node_mode'"):
        config.vfio.node_mode = 0o644  # type: ignore[misc]
    assert config.vfio.replace(retries=1) == VfioConfig(node_mode=0o600, retries=1)
    assert repr(VfioConfig()).startswith("VfioConfig(node_mode=438, allow_unsafe_interrupts='auto'")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nodemode'"):
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


def test_a_device_rule_has_no_vendor_or_device_by_default():
    """Its annotations say int: a rule is never built without both, from the file or in code."""
    with pytest.raises(TypeError, match=r"missing 1 required .*'device'"):
        MatchRule(vendor=0x1234)
    rule = MatchRule(vendor=0x1234, device=0x11E8)
    assert (rule.vendor, rule.device, rule.subsystem_vendor) == (0x1234, 0x11E8, None)


# --- numbers that parse but break later: refused at load, naming file and key -----------------

SECTIONS = {
    name: option.default.__class__
    for name, option in Config.options.items()
    if hasattr(option.default, "options")
}
NUMERIC_KEYS = sorted(
    f"{section}.{key}"
    for section, cls in SECTIONS.items()
    for key, option in cls.options.items()
    if isinstance(option.default, (int, float)) and not isinstance(option.default, bool)
)


def test_every_numeric_key_is_listed():
    """A new numeric key joins the table below (and so gets limits) or this fails."""
    assert NUMERIC_KEYS == [
        "guest_attributes.min_interval",
        "metadata.boot_deadline", "metadata.max_body", "metadata.timeout", "metadata.watch_timeout",
        "metrics.port", "notices.hook_deadline", "ready.device_deadline", "recovery.max_resets_per_hour",
        "runtime_metrics.interval", "runtime_metrics.timeout",
        "supervisor.backoff_initial", "supervisor.backoff_max", "supervisor.pull_retries",
        "supervisor.stable_after", "vfio.node_mode", "vfio.node_timeout", "vfio.retries",
    ]  # fmt: skip


HOSTILE = [
    ".nan",
    ".NaN",
    ".inf",
    "-.inf",
    "-1",
    "1" + "0" * 400,
    "1e400",
    "-0.0",
    "true",
    "'5x'",
    "[5]",
    "null",
]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("dotted", NUMERIC_KEYS)
def test_non_finite_negative_huge_and_non_numbers_are_refused_for_every_numeric_key(dotted, value):
    section, key = dotted.split(".")
    with pytest.raises(ConfigError) as info:
        parse_config(f"{section}:\n  {key}: {value}\n", SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: {dotted}: ") and "\n" not in message and len(message) < 300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("metrics: {port: 65536}", "metrics.port: 65536 is not a whole number from 1 to 65535"),
        ("metrics: {port: 0}", "metrics.port: 0 is not a whole number from 1 to 65535"),
        ("vfio: {node_mode: '07777'}", "vfio.node_mode: 4095 is not a file mode from 0000 to 0777"),
        ("vfio: {node_mode: '17777'}", "vfio.node_mode: 8191 is not a file mode"),
        ("vfio: {node_timeout: 0}", "vfio.node_timeout: 0 is out of range; give seconds above 0"),
        ("vfio: {node_timeout: 86400}", "at most 3600"),
        ("vfio: {retries: 1000000}", "vfio.retries: 1000000 is not a whole number from 0 to 100"),
        ("metadata: {boot_deadline: 600}", "at most 150 .systemd's TimeoutStartSec=180"),
        ("metadata: {watch_timeout: 0}", "metadata.watch_timeout: 0 is not a whole number from 1"),
        ("metadata: {max_body: 0}", "metadata.max_body: 0 is not a whole number from 1024"),
        ("metadata: {max_body: 1099511627776}", "to 67108864 bytes"),
        (
            "supervisor: {backoff_initial: 10, backoff_max: 5}",
            "supervisor: backoff_max .5. is below backoff_init",
        ),
        ("vfio: {node_timeout: 2001-02-30}", "tpuboot.yaml: a value cannot be read .day is out of range"),
        ("devices: [{vendor: .nan, device: 1}]", r"devices\[0\].vendor: nan is not a 16-bit PCI id"),
    ],
)
def test_out_of_range_values_name_file_key_and_limit(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text, SOURCE)
    assert str(info.value).startswith(SOURCE) and "\n" not in str(info.value)


def test_an_integer_yaml_cannot_build_is_a_config_error():
    """PyYAML's int() refuses 5000 digits (Python 3.11+) with ValueError, not YAMLError."""
    with pytest.raises(ConfigError, match=r"^/etc/tpuboot/tpuboot.yaml: .*vfio.retries|cannot be read"):
        parse_config("vfio: {retries: 1" + "0" * 5000 + "}", SOURCE)


def test_edge_values_are_accepted():
    config = parse_config(
        "vfio: {node_mode: '0000', node_timeout: 3600, retries: 0}\n"
        "metadata: {timeout: 0.001, boot_deadline: 150, max_body: 1024, watch_timeout: 1}\n"
        "metrics: {port: 65535}\nsupervisor: {backoff_initial: 5, backoff_max: 5}\n",
        SOURCE,
    )
    assert (config.vfio.node_mode, config.vfio.node_timeout, config.metrics.port) == (0, 3600.0, 65535)
    assert isinstance(config.vfio.node_timeout, float) and config.metadata.boot_deadline == 150.0


def test_the_daemon_runs_on_defaults_after_a_bad_number(tmp_path, monkeypatch, capsys):
    """`tpuboot run` logs the refusal naming file and key, then starts with the built-in config."""
    from tpuboot import cli

    path = tmp_path / "etc/tpuboot/tpuboot.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("metrics: {port: 99999}\n")
    seen = []

    def stop_here(root, config, **seams):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr("tpuboot.wiring.build", stop_here)
    with pytest.raises(SystemExit):
        cli.main(["--root", str(tmp_path), "run"])
    err = capsys.readouterr().err
    assert "/etc/tpuboot/tpuboot.yaml: metrics.port: 99999 is not a whole number" in err
    assert "running with built-in defaults" in err
    assert seen[0].vfio == VfioConfig()


TRISTATES = ["vfio.allow_unsafe_interrupts", "guest_attributes.enabled", "gke"]


def test_every_auto_true_false_key_is_a_tristate():
    """One alias for the three-valued settings: each such key takes exactly its values, and a
    YAML boolean as its word."""
    hints = {
        f"{name}.{key}" if name else key: hint
        for name, cls in [("", Config), *((n, type(getattr(Config(), n))) for n in SECTIONS)]
        for key, hint in typing.get_type_hints(cls).items()
    }
    assert sorted(k for k, hint in hints.items() if hint == TriState) == sorted(TRISTATES)
    for dotted in TRISTATES:
        section, _, key = dotted.rpartition(".")
        for value, word in [*((v, v) for v in typing.get_args(TriState)), ("yes", "true"), ("off", "false")]:
            text = f"{section}: {{{key}: {value}}}" if section else f"{key}: {value}"
            config = parse_config(text, SOURCE)
            assert getattr(getattr(config, section) if section else config, key) == word
        with pytest.raises(ConfigError, match="is not one of auto, true, false"):
            parse_config(f"{section}: {{{key}: maybe}}" if section else f"{key}: maybe", SOURCE)


def test_a_tristate_reads_as_a_decision_or_none_for_auto():
    """The one reading of auto/true/false (gke, vfio.allow_unsafe_interrupts): auto decides nothing."""
    assert [decided(v) for v in typing.get_args(TriState)] == [None, True, False]
    assert decided(parse_config("gke: yes", SOURCE).gke) is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vbar: {registries: []}", "vbar.registries: expected a non-empty list of registry hosts"),
        ("vbar: {registries: [gcr.io, 3]}", r"vbar.registries\[1\]: 3 is not a string; quote it"),
        ("vbar: {registries: [gcr.io, 'a b']}", r"vbar.registries\[1\]: 'a b' is not a registry host"),
        ("registry_auth: {token_registries: {}}", "token_registries: expected a list of registry hosts"),
        ("registry_auth: {token_registries: [x/y]}", r"token_registries\[0\]: 'x/y': give the registry host"),
        ("doctor: {job_units: train.service}", "doctor.job_units: expected a list of systemd units"),
        ("doctor: {job_units: [a.service, .scope]}", r"job_units\[1\]: '.scope' is not a unit name like"),
    ],
)
def test_a_list_of_names_is_refused_as_a_whole_or_by_its_item(text, message):
    """The lists of names (registries, token registries, job units), read by one parser: a value
    that is no list, or an item that is not a name of its kind, said with the item's index."""
    with pytest.raises(ConfigError, match=message):
        parse_config(text, SOURCE)


def test_an_empty_list_of_names_is_taken_where_none_is_a_choice():
    config = parse_config("registry_auth: {token_registries: []}\ndoctor: {job_units: []}", SOURCE)
    assert (config.registry_auth.token_registries, config.doctor.job_units) == ((), ())
