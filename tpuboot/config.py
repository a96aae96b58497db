"""The configuration file, ``/etc/tpuboot/tpuboot.yaml``: every key optional, unknown keys refused.

Each section is a frozen record (``Section``); a field's parser turns the YAML value into the
typed value or raises ConfigError naming the key and the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tpuboot.errors import ConfigError
from tpuboot.paths import Root

# typing's own flag without importing typing, which costs `tpuboot bind` 10.5 M instructions (10%
# of importing tpuboot.cli: valgrind on the host, python3 -S): its names serve the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar

CONFIG_PATH = "/etc/tpuboot/tpuboot.yaml"

Parser = Callable[["Any", str], "Any"]


def _fail(where: str, problem: str) -> ConfigError:
    return ConfigError(f"{where}: {problem}")


def _shown(value: object) -> str:
    """A value as a message shows it: its repr, cut short (a number may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(where: str, key: object) -> str:
    """``file: a.b`` for key b under a, so messages name both the file and the key."""
    return f"{where}.{key}" if ": " in where else f"{where}: {key}"


def parse_hex_id(value: Any, where: str) -> int:
    """A 16-bit PCI id: YAML int (0x1ae0) or string ('0x1ae0' / '1ae0')."""
    if isinstance(value, bool):
        raise _fail(where, "expected a 16-bit PCI id such as 0x1ae0")
    if isinstance(value, str):
        text = value.lower().removeprefix("0x")
        if not text or any(c not in "0123456789abcdef" for c in text):
            raise _fail(where, f"{value!r} is not a hex PCI id; write it like 0x1ae0")
        value = int(text, 16)
    if not isinstance(value, int) or not 0 <= value <= 0xFFFF:
        raise _fail(where, f"{_shown(value)} is not a 16-bit PCI id; write it like 0x1ae0")
    return value


def parse_mode(value: Any, where: str) -> int:
    """A file mode, best written quoted ('0666'); YAML's own octal 0666 is accepted too."""
    if isinstance(value, str) and value and all(c in "01234567" for c in value):
        value = int(value, 8)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        # Also refuses set-id and sticky bits (0o7000): they mean nothing on a device node.
        raise _fail(
            where,
            f"{_shown(value)} is not a file mode from 0000 to 0777; write it quoted in octal, like '0666'",
        )
    return value


def parse_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"{value!r} is not true or false")
    return value


def parse_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"{value!r} is not a string; quote it")
    return value


def parse_optional_str(value: Any, where: str) -> str | None:
    return None if value is None else parse_str(value, where)


def parse_abs_path(value: Any, where: str) -> str:
    text = parse_str(value, where)
    if not text.startswith("/"):
        raise _fail(where, f"{text!r} is not an absolute path")
    return text


def parse_seconds(most: float, why: str = "") -> Parser:
    """A duration above 0 and at most ``most`` seconds; ``why`` says where the limit comes from.

    NaN fails every comparison and .inf is above any limit, so neither gets through to a timer,
    a socket or a deadline, where each fails later and far from the file (OverflowError, a wait
    that never ends, a deadline always passed).
    """

    def parse(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(where, f"{_shown(value)} is not a number of seconds; write it like 5.0")
        if not 0 < value <= most:  # before float(): an int of 400 digits would overflow it
            raise _fail(
                where, f"{_shown(value)} is out of range; give seconds above 0 and at most {most:g}{why}"
            )
        return float(value)

    return parse


def parse_whole(least: int, most: int, why: str = "") -> Parser:
    """A whole number from ``least`` to ``most``; ``why`` says where the limits come from."""

    def parse(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise _fail(where, f"{_shown(value)} is not a whole number from {least} to {most}{why}")
        return value

    return parse


def parse_choice(*choices: str) -> Parser:
    def parse(value: Any, where: str) -> str:
        # YAML 1.1 reads bare yes/no/on/off as booleans; map them back.
        if value is True:
            value = "true"
        elif value is False:
            value = "false"
        if value not in choices:
            raise _fail(where, f"{value!r} is not one of {', '.join(choices)}")
        return str(value)

    return parse


def parse_str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise _fail(where, "expected a mapping of NAME: 'value'")
    out: dict[str, str] = {}
    for key, item in value.items():
        out[parse_str(key, where)] = parse_str(item, _key(where, key))
    return out


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of an option the file must give.
REQUIRED: Any = _Required()


class _Option:
    """A section field's default and parser."""

    __slots__ = ("default", "parse")

    def __init__(self, default: Any, parse: Parser) -> None:
        self.default = default
        self.parse = parse

    def fresh_default(self) -> Any:
        """The default; a mutable one copied, so no two records share it."""
        return type(self.default)(self.default) if isinstance(self.default, (dict, list)) else self.default


def _opt(default: Any, parse: Parser) -> Any:
    """A config field with its default (or REQUIRED) and its parser."""
    return _Option(default, parse)


class Section:
    """A frozen record of ``_opt`` fields, equal by value.

    Not a dataclass, measured (valgrind instruction counts, python3 -S, on the host): importing
    dataclasses after tpuboot.cli costs 20 M instructions (it brings inspect), and each frozen,
    slotted dataclass 3.3 M more to generate; for these twelve sections, the device table's three
    records and BindResult, about 73 M, two thirds of what importing tpuboot.cli costs (108 M) and
    nearly half of a whole `tpuboot bind` (156 M in the bench's icount guest), on every run.
    """

    options: ClassVar[dict[str, _Option]] = {}

    def __init_subclass__(cls) -> None:
        cls.options = {name: value for name, value in vars(cls).items() if isinstance(value, _Option)}
        for name in cls.options:
            delattr(cls, name)  # the value lives on each instance

    def __init__(self, **values: Any) -> None:
        if unknown := values.keys() - self.options.keys():
            raise TypeError(f"{type(self).__name__}() got unexpected fields {sorted(unknown)}")
        for name, option in self.options.items():
            if name not in values and option.default is REQUIRED:
                raise TypeError(f"{type(self).__name__}() needs {name}")
            object.__setattr__(self, name, values[name] if name in values else option.fresh_default())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen; use replace({name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def check(self, where: str) -> None:
        """Refuse combinations of values that each parse (a section overrides this)."""

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.options)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.options)
        return f"{type(self).__name__}({fields})"

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied."""
        return type(self)(**{**{name: getattr(self, name) for name in self.options}, **changes})


def _section(cls: type[Section], data: Any, where: str) -> Any:
    """Build section ``cls`` from a YAML mapping, refusing unknown keys."""
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise _fail(where, f"expected a mapping, got {type(data).__name__}")
    values = {}
    for key, value in data.items():
        if key not in cls.options:
            known = ", ".join(sorted(cls.options))
            raise _fail(where, f"unknown key {key!r} (known keys: {known})")
        values[key] = cls.options[key].parse(value, _key(where, key))
    required = [name for name, option in cls.options.items() if option.default is REQUIRED]
    if not values.keys() >= set(required):
        raise _fail(where, f"{' and '.join(required)} {'are' if len(required) > 1 else 'is'} required")
    section = cls(**values)
    section.check(where)
    return section


class MatchRule(Section):
    """One extra device the operator wants bound to vfio-pci."""

    vendor: int = _opt(REQUIRED, parse_hex_id)
    device: int = _opt(REQUIRED, parse_hex_id)
    subsystem_vendor: int | None = _opt(None, parse_hex_id)
    subsystem_device: int | None = _opt(None, parse_hex_id)
    name: str = _opt("", parse_str)


def parse_rules(value: Any, where: str) -> tuple[MatchRule, ...]:
    if not isinstance(value, list):
        raise _fail(where, "expected a list of {vendor, device[, subsystem_vendor, subsystem_device, name]}")
    rules = []
    for index, item in enumerate(value):
        here = f"{where}[{index}]"
        rule = _section(MatchRule, item, here)
        if (rule.subsystem_vendor is None) != (rule.subsystem_device is None):
            raise _fail(here, "give both subsystem_vendor and subsystem_device, or neither")
        rules.append(rule)
    return tuple(rules)


# The limits of the numeric keys, each a value past which the setting can only be a mistake.
#: systemd's TimeoutStartSec=180 (systemd/tpuboot.service) ends a start that has not sent READY;
#: READY waits for the boot-time tpu-env fetch, and coldplug and start-up need the rest.
BOOT_DEADLINE_MAX = 150.0
#: A single network or device wait longer than an hour is a hang, not patience.
WAIT_MAX = 3600.0
#: Supervisor delays: a day is beyond any restart policy (and within what timers accept).
DELAY_MAX = 86400.0
#: Retries: the backoff reaches its cap after a few; more only lengthens a failure's series.
RETRIES_MAX = 100
#: A metadata body larger than this is held in memory whole: tpu-env is a few KiB.
MAX_BODY_MAX = 64 << 20


class VfioConfig(Section):
    """How a bound device is made usable."""

    node_mode: int = _opt(0o666, parse_mode)
    allow_unsafe_interrupts: str = _opt("auto", parse_choice("auto", "true", "false"))
    node_timeout: float = _opt(5.0, parse_seconds(WAIT_MAX))
    retries: int = _opt(5, parse_whole(0, RETRIES_MAX))


class MetadataConfig(Section):
    """Where and how patiently to ask the GCE metadata server."""

    host: str | None = _opt(None, parse_optional_str)
    timeout: float = _opt(5.0, parse_seconds(WAIT_MAX))
    boot_deadline: float = _opt(
        60.0, parse_seconds(BOOT_DEADLINE_MAX, " (systemd's TimeoutStartSec=180 must not end the start)")
    )
    max_body: int = _opt(1 << 20, parse_whole(1024, MAX_BODY_MAX, " bytes"))
    watch: bool = _opt(True, parse_bool)
    # 0 would make every long-poll return at once: a busy loop against the metadata server.
    watch_timeout: int = _opt(60, parse_whole(1, int(WAIT_MAX), " seconds"))


DEFAULT_ENVIRONMENT = {
    "CLOUDSDK_PYTHON": "/usr/bin/python3",
    "GCS_RESOLVE_REFRESH_SECS": "60",
    "GCS_REQUEST_CONNECTION_TIMEOUT_SECS": "300",
    "GCS_METADATA_REQUEST_TIMEOUT_SECS": "300",
    "GCS_READ_REQUEST_TIMEOUT_SECS": "300",
    "GCS_WRITE_REQUEST_TIMEOUT_SECS": "600",
}


class EnvConfig(Section):
    """The runtime environment files written from metadata and defaults."""

    enabled: bool = _opt(True, parse_bool)
    tpu_env_path: str = _opt("/home/tpu-runtime/tpu-env", parse_abs_path)
    cache_dir: str = _opt("/var/lib/tpuboot", parse_abs_path)
    environment_path: str = _opt("/etc/environment", parse_abs_path)
    environment: dict[str, str] = _opt(DEFAULT_ENVIRONMENT, parse_str_map)
    # tpu-env's values again for systemd's EnvironmentFile= and `docker run --env-file` (null: not written).
    systemd_env_path: str | None = _opt(
        "/run/tpuboot/tpu-env.env", lambda v, w: parse_optional_abs_path(v, w)
    )
    docker_env_path: str | None = _opt(
        "/run/tpuboot/tpu-env.docker", lambda v, w: parse_optional_abs_path(v, w)
    )


def parse_argv(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise _fail(where, "expected a non-empty list of strings (program and its arguments)")
    return tuple(value)


def parse_optional_abs_path(value: Any, where: str) -> str | None:
    return None if value is None else parse_abs_path(value, where)


# The documented boot-time form of the vBar agent when run without a container.
VBAR_EXEC_ARGV = (
    "/usr/bin/vbar_control_agent",
    "--logtostderr",
    "--gid=",
    "--uid=",
    "--chroot=",
    "--census_enabled=false",
    "--loas_pwd_fallback_in_corp",
)


class SupervisorConfig(Section):
    """Restart policy of a supervised agent: capped exponential backoff, reset after a stable run."""

    backoff_initial: float = _opt(1.0, parse_seconds(DELAY_MAX))
    backoff_max: float = _opt(300.0, parse_seconds(DELAY_MAX))
    stable_after: float = _opt(600.0, parse_seconds(DELAY_MAX))
    pull_retries: int = _opt(5, parse_whole(0, RETRIES_MAX))

    def check(self, where: str) -> None:
        if self.backoff_max < self.backoff_initial:
            raise _fail(
                where,
                f"backoff_max ({self.backoff_max:g}) is below backoff_initial ({self.backoff_initial:g}); "
                "raise backoff_max or lower backoff_initial",
            )


#: The registries the documented procedure pulls its privileged images from: gcr.io for both
#: images, us-docker.pkg.dev (Artifact Registry) for the `gcloud auth configure-docker` step.
DEFAULT_REGISTRIES = ("gcr.io", "us-docker.pkg.dev")


def parse_registries(value: Any, where: str) -> tuple[str, ...]:
    """A non-empty list of registry hosts (``host[:port]``), each optionally with a path prefix."""
    from tpuboot.references import parse_entry

    if not isinstance(value, list) or not value:
        raise _fail(where, "expected a non-empty list of registry hosts, like [gcr.io, us-docker.pkg.dev]")
    for index, item in enumerate(value):
        try:
            parse_entry(parse_str(item, f"{where}[{index}]"))
        except ValueError as exc:
            raise _fail(f"{where}[{index}]", str(exc)) from None
    return tuple(value)


class _PrivilegedImage(Section):
    """A section naming a privileged container's image and the registries it may come from."""

    name: ClassVar[str] = ""
    image: str  # each subclass's option
    registries: tuple[str, ...]

    def check(self, where: str) -> None:
        """An image of the file's own that its allowlist refuses is a mistake: say so at load."""
        from tpuboot.references import ImageRefused, RegistryAllowlist

        allowlist = RegistryAllowlist(self.registries, f"{self.name}.registries")
        try:
            allowlist.check(self.image, f"{self.name}.image")
        except ImageRefused as exc:
            raise _fail(_key(where, "image"), f"{exc}, or change {self.name}.image") from None


class VbarConfig(_PrivilegedImage):
    """The vBar control agent (needed for ICI), supervised unless on a GKE node."""

    name = "vbar"
    enabled: bool = _opt(True, parse_bool)
    runtime: str = _opt("docker", parse_choice("docker", "exec"))
    # Used when tpu-env's VBARCONTROL_AGENT_DOCKER_URL is empty or absent.
    image: str = _opt("gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1", parse_str)
    container_name: str = _opt("tpuboot-vbar-control-agent", parse_str)
    exec_argv: tuple[str, ...] = _opt(VBAR_EXEC_ARGV, parse_argv)
    # Where the image (this one or tpu-env's) may come from; any other is refused, not run.
    registries: tuple[str, ...] = _opt(DEFAULT_REGISTRIES, parse_registries)


class TelemetryConfig(_PrivilegedImage):
    """The optional AI telemetry collector container."""

    name = "telemetry"
    enabled: bool = _opt(False, parse_bool)
    image: str = _opt("gcr.io/cloud-tpu-v2-images/ai-telemetry-collector:latest", parse_str)
    container_name: str = _opt("tpuboot-ai-telemetry-collector", parse_str)
    # A config.yaml on the host, bind-mounted read-only into the collector when set.
    config_path: str | None = _opt(None, parse_optional_abs_path)
    # Where the collector finds config_path inside its container (null: the same path as on the host).
    config_target: str | None = _opt(None, parse_optional_abs_path)
    registries: tuple[str, ...] = _opt(DEFAULT_REGISTRIES, parse_registries)


#: Google's registries, as docker's credential helpers for them know them: Container Registry
#: (gcr.io and its regional hosts) and Artifact Registry's docker hosts (LOCATION-docker.pkg.dev).
DEFAULT_TOKEN_REGISTRIES = ("gcr.io", "*.gcr.io", "*-docker.pkg.dev")


def parse_token_registries(value: Any, where: str) -> tuple[str, ...]:
    """A list (maybe empty) of registry hosts, each ``host[:port]`` or ``*`` and the rest of a host."""
    from tpuboot.references import parse_host_pattern

    if not isinstance(value, list):
        raise _fail(where, "expected a list of registry hosts, like [gcr.io, '*-docker.pkg.dev'], or []")
    for index, item in enumerate(value):
        try:
            parse_host_pattern(parse_str(item, f"{where}[{index}]"))
        except ValueError as exc:
            raise _fail(f"{where}[{index}]", str(exc)) from None
    return tuple(value)


class RegistryAuthConfig(Section):
    """Which registries a pull sends the VM's service-account token to (tpuboot/containers/credentials.py)."""

    token_registries: tuple[str, ...] = _opt(DEFAULT_TOKEN_REGISTRIES, parse_token_registries)


class MetricsConfig(Section):
    """Prometheus metrics on loopback, and a node_exporter textfile directory for one-shot commands."""

    enabled: bool = _opt(True, parse_bool)
    address: str = _opt("127.0.0.1", parse_str)
    # 0 would listen on a port the kernel picks, which no scraper knows.
    port: int = _opt(9431, parse_whole(1, 65535, " (a TCP port)"))
    textfile_dir: str | None = _opt(None, parse_optional_abs_path)


#: The server's guest-attribute quota is 10 queries a minute per VM; 5 keys at most once per 30 s
#: each stay within it (tpuboot/guestattrs.py).
GUEST_ATTRIBUTES_MIN_INTERVAL = 30.0


def parse_publish_interval(value: Any, where: str) -> float:
    seconds: float = parse_seconds(DELAY_MAX)(value, where)
    if seconds < GUEST_ATTRIBUTES_MIN_INTERVAL:
        raise _fail(
            where,
            f"{seconds:g} is below {GUEST_ATTRIBUTES_MIN_INTERVAL:g} s; the metadata server allows 10 "
            "guest-attribute writes a minute per VM and may drop writes beyond that",
        )
    return seconds


class GuestAttributesConfig(Section):
    """This host's state in the instance's guest attributes (tpuboot/<key>), for slice-wide views."""

    # auto: when enable-guest-attributes is TRUE on the instance (else on the project).
    enabled: str = _opt("auto", parse_choice("auto", "true", "false"))
    min_interval: float = _opt(60.0, parse_publish_interval)


class ReadyConfig(Section):
    """When the unit says READY."""

    # Hold READY until every TPU present at start is bound or has failed for good.
    wait_for_devices: bool = _opt(True, parse_bool)
    device_deadline: float = _opt(
        90.0, parse_seconds(BOOT_DEADLINE_MAX, " (systemd's TimeoutStartSec=180 must not end the start)")
    )


#: What a job's unit name may end with (systemd's unit types that run processes).
UNIT_SUFFIXES = (".service", ".scope")


def parse_units(value: Any, where: str) -> tuple[str, ...]:
    """A list (maybe empty) of systemd unit names, each ``NAME.service`` or ``NAME.scope``."""
    if not isinstance(value, list):
        raise _fail(where, "expected a list of systemd units, like [train.service], or []")
    for index, item in enumerate(value):
        unit = parse_str(item, f"{where}[{index}]")
        if not unit.endswith(UNIT_SUFFIXES) or "/" in unit or unit.startswith(UNIT_SUFFIXES):
            raise _fail(f"{where}[{index}]", f"{unit!r} is not a unit name like train.service")
    return tuple(value)


class DoctorConfig(Section):
    """What `tpuboot doctor` looks at beyond tpuboot's own work."""

    # The units that run TPU jobs: doctor checks their main process's memlock limit.
    job_units: tuple[str, ...] = _opt((), parse_units)


class RecoveryConfig(Section):
    """`tpuboot reset`'s circuit breaker: a chip that wedges again and again needs a new host."""

    max_resets_per_hour: int = _opt(3, parse_whole(1, 60, " (resets of one chip in any hour)"))


class Config(Section):
    devices: tuple[MatchRule, ...] = _opt((), parse_rules)
    vfio: VfioConfig = _opt(VfioConfig(), lambda v, w: _section(VfioConfig, v, w))
    metadata: MetadataConfig = _opt(MetadataConfig(), lambda v, w: _section(MetadataConfig, v, w))
    env: EnvConfig = _opt(EnvConfig(), lambda v, w: _section(EnvConfig, v, w))
    # GKE runs vBar and the telemetry collector itself: auto detects a GKE node from metadata.
    gke: str = _opt("auto", parse_choice("auto", "true", "false"))
    vbar: VbarConfig = _opt(VbarConfig(), lambda v, w: _section(VbarConfig, v, w))
    telemetry: TelemetryConfig = _opt(TelemetryConfig(), lambda v, w: _section(TelemetryConfig, v, w))
    supervisor: SupervisorConfig = _opt(SupervisorConfig(), lambda v, w: _section(SupervisorConfig, v, w))
    registry_auth: RegistryAuthConfig = _opt(
        RegistryAuthConfig(), lambda v, w: _section(RegistryAuthConfig, v, w)
    )
    metrics: MetricsConfig = _opt(MetricsConfig(), lambda v, w: _section(MetricsConfig, v, w))
    guest_attributes: GuestAttributesConfig = _opt(
        GuestAttributesConfig(), lambda v, w: _section(GuestAttributesConfig, v, w)
    )
    ready: ReadyConfig = _opt(ReadyConfig(), lambda v, w: _section(ReadyConfig, v, w))
    doctor: DoctorConfig = _opt(DoctorConfig(), lambda v, w: _section(DoctorConfig, v, w))
    recovery: RecoveryConfig = _opt(RecoveryConfig(), lambda v, w: _section(RecoveryConfig, v, w))


def _sets_nothing(text: str) -> bool:
    """True for a file of comments and blank lines, like the shipped one: no YAML parser needed."""
    return all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())


def parse_config(text: str, source: str) -> Config:
    """Parse YAML text; ``source`` names the file in error messages."""
    if _sets_nothing(text):
        return Config()  # `tpuboot bind` starts without importing yaml (0.2 s under emulation)
    config: Config = _section(Config, _yaml_data(text, source), source)
    return config


def _yaml_data(text: str, source: str) -> Any:
    """What PyYAML reads in ``text``; a ConfigError naming ``source`` if it cannot."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}:{line} is not valid YAML; fix the syntax") from None
    except (ValueError, OverflowError, TypeError, RecursionError) as exc:
        # PyYAML builds some scalars with int() or datetime(): 2001-02-30, an int of 5000 digits.
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:80]
        raise ConfigError(f"{source}: a value cannot be read ({reason}); quote it or fix it") from None


def load_config(root: Root, path: str | None = None) -> Config:
    """Read the configuration file; a missing default file means all defaults.

    PyYAML's result for the file's exact text is kept under the Root (tpuboot/configcache.py), so
    an unchanged file loads without importing yaml; validation runs on it all the same.
    """
    wanted = path or CONFIG_PATH
    real = root.path(wanted)
    try:
        text = real.read_text(encoding="utf-8")
    except FileNotFoundError:
        if path is None:
            return Config()
        raise ConfigError(f"{wanted}: no such file; check the --config path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{wanted}: cannot read ({exc}); fix its permissions or encoding") from None
    if _sets_nothing(text):
        return Config()
    from tpuboot import configcache

    data = configcache.lookup(root, text)
    if data is configcache.MISS:
        data = _yaml_data(text, wanted)  # bad YAML raises here: nothing is kept
        configcache.store(root, text, data)  # before validation: a hit fails it the same way
    config: Config = _section(Config, data, wanted)
    return config
