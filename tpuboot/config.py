"""The configuration file, ``/etc/tpuboot/tpuboot.yaml``: every key optional, unknown keys refused.

Each section is a frozen dataclass of fields read by their parsers (tpuboot/configfields.py);
a value that does not parse, or a combination that cannot work, is a ConfigError naming the key
and the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from tpuboot.configfields import (
    REQUIRED,
    Section,
    fail,
    key_of,
    option,
    parse_abs_path,
    parse_bool,
    parse_choice,
    parse_hex_id,
    parse_mode,
    parse_optional_abs_path,
    parse_optional_str,
    parse_seconds,
    parse_section,
    parse_str,
    parse_str_list,
    parse_str_map,
    parse_whole,
    section_parser,
)
from tpuboot.endpoints import VBAR_ENDPOINT, Endpoint, EndpointError, parse_endpoint
from tpuboot.errors import ConfigError
from tpuboot.gce.settings import DEFAULT_MAX_BODY, DEFAULT_TIMEOUT
from tpuboot.paths import Root

CONFIG_PATH = "/etc/tpuboot/tpuboot.yaml"

#: A setting that is on, off, or decided from what the host says (``auto``): the strings the
#: file gives; :func:`decided` reads one as a decision.
TriState = Literal["auto", "true", "false"]
parse_tristate = parse_choice(*get_args(TriState))
#: How the vBar agent runs: in its container, or the documented binary on the host.
VbarRuntime = Literal["docker", "exec"]


def decided(setting: TriState) -> bool | None:
    """A :data:`TriState` as a decision: True or False as the file says it, None for ``auto``
    (what the host says decides)."""
    return None if setting == "auto" else setting == "true"


@dataclass(frozen=True)
class MatchRule(Section):
    """One extra device the operator wants bound to vfio-pci."""

    vendor: int = option(REQUIRED, parse_hex_id)
    device: int = option(REQUIRED, parse_hex_id)
    subsystem_vendor: int | None = option(None, parse_hex_id)
    subsystem_device: int | None = option(None, parse_hex_id)
    name: str = option("", parse_str)


def parse_rules(value: Any, where: str) -> tuple[MatchRule, ...]:
    if not isinstance(value, list):
        raise fail(where, "expected a list of {vendor, device[, subsystem_vendor, subsystem_device, name]}")
    rules = []
    for index, item in enumerate(value):
        here = f"{where}[{index}]"
        rule = parse_section(MatchRule, item, here)
        if (rule.subsystem_vendor is None) != (rule.subsystem_device is None):
            raise fail(here, "give both subsystem_vendor and subsystem_device, or neither")
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


@dataclass(frozen=True)
class VfioConfig(Section):
    """How a bound device is made usable."""

    node_mode: int = option(0o666, parse_mode)
    allow_unsafe_interrupts: TriState = option("auto", parse_tristate)
    node_timeout: float = option(5.0, parse_seconds(WAIT_MAX))
    retries: int = option(5, parse_whole(0, RETRIES_MAX))


@dataclass(frozen=True)
class MetadataConfig(Section):
    """Where and how patiently to ask the GCE metadata server."""

    host: str | None = option(None, parse_optional_str)
    timeout: float = option(DEFAULT_TIMEOUT, parse_seconds(WAIT_MAX))
    boot_deadline: float = option(
        60.0, parse_seconds(BOOT_DEADLINE_MAX, " (systemd's TimeoutStartSec=180 must not end the start)")
    )
    max_body: int = option(DEFAULT_MAX_BODY, parse_whole(1024, MAX_BODY_MAX, " bytes"))
    watch: bool = option(True, parse_bool)
    # 0 would make every long-poll return at once: a busy loop against the metadata server.
    watch_timeout: int = option(60, parse_whole(1, int(WAIT_MAX), " seconds"))


DEFAULT_ENVIRONMENT = {
    "CLOUDSDK_PYTHON": "/usr/bin/python3",
    "GCS_RESOLVE_REFRESH_SECS": "60",
    "GCS_REQUEST_CONNECTION_TIMEOUT_SECS": "300",
    "GCS_METADATA_REQUEST_TIMEOUT_SECS": "300",
    "GCS_READ_REQUEST_TIMEOUT_SECS": "300",
    "GCS_WRITE_REQUEST_TIMEOUT_SECS": "600",
}


@dataclass(frozen=True)
class EnvConfig(Section):
    """The runtime environment files written from metadata and defaults."""

    enabled: bool = option(True, parse_bool)
    tpu_env_path: str = option("/home/tpu-runtime/tpu-env", parse_abs_path)
    cache_dir: str = option("/var/lib/tpuboot", parse_abs_path)
    environment_path: str = option("/etc/environment", parse_abs_path)
    environment: dict[str, str] = option(DEFAULT_ENVIRONMENT, parse_str_map)
    # tpu-env's values again for systemd's EnvironmentFile= and `docker run --env-file` (null: not written).
    systemd_env_path: str | None = option("/run/tpuboot/tpu-env.env", parse_optional_abs_path)
    docker_env_path: str | None = option("/run/tpuboot/tpu-env.docker", parse_optional_abs_path)


def parse_argv(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise fail(where, "expected a non-empty list of strings (program and its arguments)")
    return tuple(value)


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


@dataclass(frozen=True)
class SupervisorConfig(Section):
    """Restart policy of a supervised agent: capped exponential backoff, reset after a stable run."""

    backoff_initial: float = option(1.0, parse_seconds(DELAY_MAX))
    backoff_max: float = option(300.0, parse_seconds(DELAY_MAX))
    stable_after: float = option(600.0, parse_seconds(DELAY_MAX))
    pull_retries: int = option(5, parse_whole(0, RETRIES_MAX))

    def check(self, where: str) -> None:
        if self.backoff_max < self.backoff_initial:
            raise fail(
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

    expected = "expected a non-empty list of registry hosts, like [gcr.io, us-docker.pkg.dev]"
    return parse_str_list(value, where, parse_entry, expected, empty=False)


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
            raise fail(key_of(where, "image"), f"{exc}, or change {self.name}.image") from None


#: Two probes at least before a restart; shorter is a restart at the first refusal.
RESTART_UNANSWERED_MIN = 10.0


def parse_endpoint_option(value: Any, where: str) -> Endpoint | None:
    """vBar's control endpoint (tpuboot/containers/liveness.py); "" or null: not checked."""
    text = None if value is None else parse_str(value, where)
    if not text:
        return None
    try:
        return parse_endpoint(text)
    except EndpointError as exc:
        raise fail(where, str(exc)) from None


def parse_restart_after(value: Any, where: str) -> float | None:
    if value is None:
        return None
    seconds: float = parse_seconds(DELAY_MAX)(value, where)
    if seconds < RESTART_UNANSWERED_MIN:
        raise fail(where, f"{seconds:g} is below {RESTART_UNANSWERED_MIN:g} s; give null (never) or more")
    return seconds


@dataclass(frozen=True)
class VbarConfig(_PrivilegedImage):
    """The vBar control agent (needed for ICI), supervised unless on a GKE node."""

    name = "vbar"
    enabled: bool = option(True, parse_bool)
    runtime: VbarRuntime = option("docker", parse_choice(*get_args(VbarRuntime)))
    # Used when tpu-env's VBARCONTROL_AGENT_DOCKER_URL is empty or absent.
    image: str = option("gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1", parse_str)
    container_name: str = option("tpuboot-vbar-control-agent", parse_str)
    exec_argv: tuple[str, ...] = option(VBAR_EXEC_ARGV, parse_argv)
    # Where the image (this one or tpu-env's) may come from; any other is refused, not run.
    registries: tuple[str, ...] = option(DEFAULT_REGISTRIES, parse_registries)
    # Where libtpu reaches it (VBAR_CONTROL_SERVICE_URL): checked while it runs; "" for never.
    endpoint: Endpoint | None = option(parse_endpoint(VBAR_ENDPOINT), parse_endpoint_option)
    # Restart the container when the endpoint has not answered this long; null: never.
    restart_unanswered_after: float | None = option(None, parse_restart_after)

    def check(self, where: str) -> None:
        super().check(where)
        if self.restart_unanswered_after is not None and self.endpoint is None:
            raise fail(
                key_of(where, "restart_unanswered_after"),
                "needs vbar.endpoint, which is empty; set the endpoint or give null",
            )


@dataclass(frozen=True)
class TelemetryConfig(_PrivilegedImage):
    """The optional AI telemetry collector container."""

    name = "telemetry"
    enabled: bool = option(False, parse_bool)
    image: str = option("gcr.io/cloud-tpu-v2-images/ai-telemetry-collector:latest", parse_str)
    container_name: str = option("tpuboot-ai-telemetry-collector", parse_str)
    # A config.yaml on the host, bind-mounted read-only into the collector when set.
    config_path: str | None = option(None, parse_optional_abs_path)
    # Where the collector finds config_path inside its container (null: the same path as on the host).
    config_target: str | None = option(None, parse_optional_abs_path)
    registries: tuple[str, ...] = option(DEFAULT_REGISTRIES, parse_registries)


#: Google's registries, as docker's credential helpers for them know them: Container Registry
#: (gcr.io and its regional hosts) and Artifact Registry's docker hosts (LOCATION-docker.pkg.dev).
DEFAULT_TOKEN_REGISTRIES = ("gcr.io", "*.gcr.io", "*-docker.pkg.dev")


def parse_token_registries(value: Any, where: str) -> tuple[str, ...]:
    """A list (maybe empty) of registry hosts, each ``host[:port]`` or ``*`` and the rest of a host."""
    from tpuboot.references import parse_host_pattern

    expected = "expected a list of registry hosts, like [gcr.io, '*-docker.pkg.dev'], or []"
    return parse_str_list(value, where, parse_host_pattern, expected)


@dataclass(frozen=True)
class RegistryAuthConfig(Section):
    """Which registries a pull sends the VM's service-account token to (tpuboot/containers/credentials.py)."""

    token_registries: tuple[str, ...] = option(DEFAULT_TOKEN_REGISTRIES, parse_token_registries)


@dataclass(frozen=True)
class MetricsConfig(Section):
    """Prometheus metrics on loopback, and a node_exporter textfile directory for one-shot commands."""

    enabled: bool = option(True, parse_bool)
    address: str = option("127.0.0.1", parse_str)
    # 0 would listen on a port the kernel picks, which no scraper knows.
    port: int = option(9431, parse_whole(1, 65535, " (a TCP port)"))
    textfile_dir: str | None = option(None, parse_optional_abs_path)


#: The guest attributes the daemon writes (tpuboot/derived.py guest_attribute_values).
GUEST_ATTRIBUTE_KEYS = 6
#: The server's guest-attribute quota is 10 queries a minute per VM: each key written at most once
#: per this many seconds keeps them all within it (tpuboot/gce/guestattrs.py).
GUEST_ATTRIBUTES_MIN_INTERVAL = 60.0 * GUEST_ATTRIBUTE_KEYS / 10


def parse_publish_interval(value: Any, where: str) -> float:
    seconds: float = parse_seconds(DELAY_MAX)(value, where)
    if seconds < GUEST_ATTRIBUTES_MIN_INTERVAL:
        raise fail(
            where,
            f"{seconds:g} is below {GUEST_ATTRIBUTES_MIN_INTERVAL:g} s; the metadata server allows 10 "
            "guest-attribute writes a minute per VM and may drop writes beyond that",
        )
    return seconds


@dataclass(frozen=True)
class GuestAttributesConfig(Section):
    """This host's state in the instance's guest attributes (tpuboot/<key>), for slice-wide views."""

    # auto: when enable-guest-attributes is TRUE on the instance (else on the project).
    enabled: TriState = option("auto", parse_tristate)
    min_interval: float = option(60.0, parse_publish_interval)


@dataclass(frozen=True)
class ReadyConfig(Section):
    """When the unit says READY."""

    # Hold READY until every TPU present at start is bound or has failed for good.
    wait_for_devices: bool = option(True, parse_bool)
    device_deadline: float = option(
        90.0, parse_seconds(BOOT_DEADLINE_MAX, " (systemd's TimeoutStartSec=180 must not end the start)")
    )


#: systemd's unit types that run processes: what a job's unit name may end with, and what names a
#: process's unit in its cgroup path (:mod:`tpuboot.holders.procfs`).
UNIT_SUFFIXES = (".service", ".scope")


def _unit_name(unit: str) -> None:
    if not unit.endswith(UNIT_SUFFIXES) or "/" in unit or unit.startswith(UNIT_SUFFIXES):
        raise ValueError(f"{unit!r} is not a unit name like train.service")


def parse_units(value: Any, where: str) -> tuple[str, ...]:
    """A list (maybe empty) of systemd unit names, each ``NAME.service`` or ``NAME.scope``."""
    return parse_str_list(
        value, where, _unit_name, "expected a list of systemd units, like [train.service], or []"
    )


@dataclass(frozen=True)
class DoctorConfig(Section):
    """What `tpuboot doctor` looks at beyond tpuboot's own work."""

    # The units that run TPU jobs: doctor checks their main process's memlock limit.
    job_units: tuple[str, ...] = option((), parse_units)


@dataclass(frozen=True)
class RecoveryConfig(Section):
    """Bringing a wedged chip back: `tpuboot reset`'s circuit breaker (a chip that wedges again and
    again needs a new host), and whether the daemon resets one by itself."""

    max_resets_per_hour: int = option(3, parse_whole(1, 60, " (resets of one chip in any hour)"))
    # The daemon resets a chip that fell off the bus or logged a fatal PCIe error, never one held.
    automatic: bool = option(False, parse_bool)


def parse_hook_user(value: Any, where: str) -> str | None:
    """A user name for the hooks (None: root); looked up by the daemon when it starts."""
    name = parse_optional_str(value, where)
    if name is not None and (not name or "/" in name or ":" in name or name.startswith("-")):
        raise fail(where, f"{name!r} is not a user name; write one like 'train', or leave it out for root")
    return name


@dataclass(frozen=True)
class NoticesConfig(Section):
    """Maintenance and preemption notices: the watch, the hooks it runs and their deadline."""

    enabled: bool = option(True, parse_bool)
    hooks_dir: str = option("/etc/tpuboot/maintenance.d", parse_abs_path)
    # All the hooks of one notice together; a preemption leaves about 30 s.
    hook_deadline: float = option(25.0, parse_seconds(600.0, " (the host does not wait longer)"))
    hook_user: str | None = option(None, parse_hook_user)


@dataclass(frozen=True)
class RuntimeMetricsConfig(Section):
    """libtpu's runtime metrics (duty cycle, HBM, fault gauges), polled while a chip is held."""

    enabled: bool = option(True, parse_bool)
    # GKE's device plugin polls every 10 s.
    interval: float = option(10.0, parse_seconds(300.0, " (a poll at least every 5 minutes)"))
    # Each call's deadline: a libtpu that does not answer costs at most this per port.
    timeout: float = option(1.0, parse_seconds(10.0, " (within the poll)"))


@dataclass(frozen=True)
class Config(Section):
    devices: tuple[MatchRule, ...] = option((), parse_rules)
    vfio: VfioConfig = option(VfioConfig(), section_parser(VfioConfig))
    metadata: MetadataConfig = option(MetadataConfig(), section_parser(MetadataConfig))
    env: EnvConfig = option(EnvConfig(), section_parser(EnvConfig))
    # GKE runs vBar and the telemetry collector itself: auto detects a GKE node from metadata.
    gke: TriState = option("auto", parse_tristate)
    vbar: VbarConfig = option(VbarConfig(), section_parser(VbarConfig))
    telemetry: TelemetryConfig = option(TelemetryConfig(), section_parser(TelemetryConfig))
    supervisor: SupervisorConfig = option(SupervisorConfig(), section_parser(SupervisorConfig))
    registry_auth: RegistryAuthConfig = option(RegistryAuthConfig(), section_parser(RegistryAuthConfig))
    metrics: MetricsConfig = option(MetricsConfig(), section_parser(MetricsConfig))
    guest_attributes: GuestAttributesConfig = option(
        GuestAttributesConfig(), section_parser(GuestAttributesConfig)
    )
    ready: ReadyConfig = option(ReadyConfig(), section_parser(ReadyConfig))
    doctor: DoctorConfig = option(DoctorConfig(), section_parser(DoctorConfig))
    recovery: RecoveryConfig = option(RecoveryConfig(), section_parser(RecoveryConfig))
    notices: NoticesConfig = option(NoticesConfig(), section_parser(NoticesConfig))
    runtime_metrics: RuntimeMetricsConfig = option(
        RuntimeMetricsConfig(), section_parser(RuntimeMetricsConfig)
    )


def _sets_nothing(text: str) -> bool:
    """True for a file of comments and blank lines, like the shipped one: no YAML parser needed."""
    return all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())


def parse_config(text: str, source: str) -> Config:
    """Parse YAML text; ``source`` names the file in error messages."""
    if _sets_nothing(text):
        return Config()  # the shipped file: nothing to parse
    return parse_section(Config, _yaml_data(text, source), source)


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
    """Read the configuration file; a missing default file means all defaults."""
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
    return parse_config(text, wanted)
