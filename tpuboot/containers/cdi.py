"""The CDI spec of the chips tpuboot bound: what lets a container use a TPU without --privileged.

The Container Device Interface (cncf-tags/container-device-interface, SPEC.md) is a JSON file that
tells podman, Docker (25+) and containerd (1.7+) which device nodes and environment to give a
container that asks for ``--device google.com/tpu=NAME``. Without one, the VFIO nodes reach a
container only with --privileged (ray-project/kuberay #2466).

Where: ``/var/run/cdi/`` (the library's dynamic directory), not ``/etc/cdi/`` (its static one).
The spec is generated from the machine as it is now (IOMMU group numbers differ between boots and
follow hotplug), and /var/run is a tmpfs, so a spec of the last boot never survives into this
one; a spec there also wins over a same-named device in /etc/cdi (the library reads /etc/cdi,
then /var/run/cdi, later directories taking precedence), and /etc may be read-only in an image.

Version: ``0.5.0``, the first that allows a device name to start with a digit (SPEC.md's table;
the chips' index names ``0``, ``1``...), and the newest that podman 4.3 (Debian 12) accepts: it
vendors container-device-interface v0.5.x, whose ``validSpecVersions`` end at 0.5.0. Docker 26 and
containerd 1.7 vendor later libraries, which accept every version up to theirs. No field newer than
0.5.0 is used (no annotations, 0.6.0): the library refuses a spec whose fields need a newer
version than it declares.

Names (SPEC.md, "CDI Devices"): alphanumerics with ``-``, ``_`` and ``.`` between. The Go library
also accepts ``:``, but the spec's grammar does not list it and Docker's ``--device`` parses
colons as ``host:container``; so a chip's address name is its base address with ``-`` for ``:``
(``0000-00-04`` for ``0000:00:04.0``).

The environment (only what the sources say libtpu reads to select chips):

- a per-chip device sets ``TPU_VISIBLE_CHIPS`` to the chip's index (libtpu numbers chips in PCI
  address order, as tpu-info and :mod:`tpuboot.devices.chips` do) with one-chip bounds:
  ``TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1`` and ``TPU_PROCESS_BOUNDS=1,1,1`` (pytorch/xla,
  torch_xla/_internal/tpu.py ``configure_one_chip_topology``), ``TPU_CHIPS_PER_HOST_BOUNDS=1,1,1``
  and ``TPU_HOST_BOUNDS=1,1,1`` (ray-project/ray, python/ray/_private/accelerators/tpu.py, the
  one-chip config after jax-ml/jax #14977; kubernetes-sigs/dra-driver-google-tpu sets the same
  pair for one chip, cmd/tpu-dra-kubeletplugin/util.go). Without them libtpu opens every chip it
  finds in sysfs and fails on the nodes the container was not given.
- ``all`` sets no selection: libtpu then sees the whole host, as it does outside a container.
- With tpu-env known (issue 33), what GKE's TPU device plugin gives a container
  (ai-on-gke/tpu-device-plugin, pkg/tpu/util), so libtpu needs neither the metadata server nor
  host networking: the spec's own edits (once for any device) carry ``TPU_SKIP_MDS_QUERY=true``,
  ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY`` (``_WRAP``, ``_ALT`` where tpu-env has them); ``all``
  adds tpu-env's host and chip bounds, worker id and hostnames; a chip adds ``TPU_WORKER_ID=0``
  and ``TPU_WORKER_HOSTNAMES=localhost`` (one host, one process) beside its one-chip bounds. Each
  device has ``TPU_RUNTIME_METRICS_PORTS``: one port per TPU device from 8431 (two per TPU7x
  chip), a chip its own of them, so several one-chip containers run side by side. With no tpu-env
  yet none of these is set (a wrong topology is worse than a metadata query), and the daemon
  rewrites the spec when tpu-env arrives or changes. A value that would break the spec or an
  engine's parser (a control character, not UTF-8, over 4 KiB) is left out, named in the journal.
- vBar: the daemon relays the unix socket ``/run/tpuboot/vbar/vbar.sock`` to ``vbar.endpoint``
  (tpuboot/containers/vbar_relay.py); its directory is mounted where GKE mounts it,
  ``/var/run/tpu-plugin``, and ``VBAR_CONTROL_SERVICE_URL`` names it: a container on any network
  (its own namespace, ``--network none``) reaches vBar with no IP traffic. No relay (vBar
  disabled, or no endpoint): neither.
- ``/tmp/tpu_logs`` (libtpu's log directory, GKE mounts one): the host's ``/var/log/tpuboot/tpu_logs``
  (mode 1777, as /tmp: a job runs as any user), so a job's logs outlive its container.

Two per-chip devices in one container would set TPU_VISIBLE_CHIPS twice (CDI appends env):
request one chip or ``all``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpuboot.atomicfile import read_file
from tpuboot.devices.chips import VFIO_CONTAINER, Chip, base_address, chips_present
from tpuboot.devices.pci import tpu_functions
from tpuboot.devices.table import DeviceTable
from tpuboot.errors import printable

if TYPE_CHECKING:
    from tpuboot.config import Config
    from tpuboot.devices.vfio import Binder
    from tpuboot.paths import Root

log = logging.getLogger("tpuboot.containers.cdi")

CDI_KIND = "google.com/tpu"
CDI_VERSION = "0.5.0"
#: The CDI library's dynamic spec directory, and the file name its GenerateSpecName gives the kind.
SPEC_DIR = "/var/run/cdi"
SPEC_PATH = f"{SPEC_DIR}/google.com-tpu.json"
ALL = "all"
ONE_CHIP_BOUNDS = "1,1,1"
SELECTION_VARIABLES = (
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
    "TPU_HOST_BOUNDS",
)

#: The first of TPU_RUNTIME_METRICS_PORTS, one port per TPU device (GKE's plugin).
METRICS_PORT = 8431
#: The relay's socket directory on the host, where GKE's plugin mounts it, and libtpu's URL there.
RELAY_DIR = "/run/tpuboot/vbar"
RELAY_SOCKET = f"{RELAY_DIR}/vbar.sock"
PLUGIN_DIR = "/var/run/tpu-plugin"
VBAR_URL = f"unix://{PLUGIN_DIR}/vbar.sock"
#: libtpu's log directory in a container, and the host directory behind it.
TPU_LOGS = "/tmp/tpu_logs"
TPU_LOGS_DIR = "/var/log/tpuboot/tpu_logs"
#: A longer tpu-env value is left out of the spec (none libtpu reads comes near it).
MAX_VALUE_BYTES = 4096
#: Spec variables from tpu-env keys (each read as KEY, else TPU_KEY): given to every device ...
SHARED_KEYS = (
    ("TPU_ACCELERATOR_TYPE", ("ACCELERATOR_TYPE",)),
    ("TPU_TOPOLOGY", ("TOPOLOGY",)),
    ("TPU_TOPOLOGY_WRAP", ("TOPOLOGY_WRAP", "WRAP")),
    ("TPU_TOPOLOGY_ALT", ("TOPOLOGY_ALT", "ALT")),
)
#: ... and to ``all`` only (a chip has its one-chip bounds and is worker 0 of localhost).
WHOLE_HOST_KEYS = (
    ("TPU_HOST_BOUNDS", ("HOST_BOUNDS",)),
    ("TPU_CHIPS_PER_HOST_BOUNDS", ("CHIPS_PER_HOST_BOUNDS",)),
    ("TPU_WORKER_ID", ("WORKER_ID",)),
    ("TPU_WORKER_HOSTNAMES", ("WORKER_HOSTNAMES",)),
)
ONE_HOST = ("TPU_WORKER_ID=0", "TPU_WORKER_HOSTNAMES=localhost")

Spec = dict[str, object]


@dataclass(frozen=True)
class Extras:
    """What the spec says beyond the chips: tpu-env's values (``known``: tpu-env is there at all),
    those left out and why, and whether the vBar relay serves its socket."""

    known: bool = False
    shared: tuple[str, ...] = ()
    whole_host: tuple[str, ...] = ()
    dropped: Mapping[str, str] = field(default_factory=dict)
    vbar: bool = False


#: Characters a YAML stream cannot hold, even inside a quoted string: the engines read the spec
#: with a YAML parser (CDI's library), which refuses the whole file for one of them. Written as
#: UTF-8 (:func:`to_json`), every other character is carried as it is.
NOT_IN_YAML = frozenset((0xFEFF, 0xFFFE, 0xFFFF))


def value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a CDI env entry every engine reads back as it is (None: it can)."""
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value):
        return "holds a control character (a newline, NUL...)"
    if any(ord(c) in NOT_IN_YAML for c in value):
        return "holds a character no YAML file may hold (U+FEFF, U+FFFE or U+FFFF)"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not UTF-8"
    if size > MAX_VALUE_BYTES:
        return f"is {size} bytes, over {MAX_VALUE_BYTES}"
    return None


def extras_of(tpu_env: Mapping[str, str] | None, vbar: bool) -> Extras:
    """The spec's extras from tpu-env's values (None: no tpu-env yet, and no topology said)."""
    if tpu_env is None:
        return Extras(vbar=vbar)
    from tpuboot.env.tpuenv import env_value  # PyYAML with it: only once tpu-env is there

    dropped: dict[str, str] = {}

    def entries(keys: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[str, ...]:
        found = []
        for name, sources in keys:
            value = next((v for v in (env_value(tpu_env, key) for key in sources) if v is not None), None)
            if value is None:
                continue
            why = value_problem(value)
            if why is None:
                found.append(f"{name}={value}")
            else:
                dropped[name] = why
        return tuple(found)

    shared = ("TPU_SKIP_MDS_QUERY=true", *entries(SHARED_KEYS))
    return Extras(True, shared, entries(WHOLE_HOST_KEYS), dropped, vbar)


def relays_vbar(config: Config) -> bool:
    """Whether the daemon serves vBar's relay socket: vBar is tpuboot's to run (enabled, not a
    node configured as GKE's, whose plugin gives its own socket) and has a control endpoint."""
    return config.vbar.enabled and config.vbar.endpoint is not None and config.gke != "true"


def host_extras(root: Root, config: Config) -> Extras:
    """The extras as the daemon writes them, for `tpuboot cdi` and doctor: tpu-env from the file
    the daemon wrote from the values it parsed (a file that does not read back: no tpu-env)."""
    values = None
    if config.env.enabled:
        data = read_file(root, config.env.tpu_env_path)
        if data is not None:
            from tpuboot.env.tpuenv import parse_env_file

            try:
                values = parse_env_file(data.decode())
            except UnicodeDecodeError:
                values = None
    return extras_of(values, relays_vbar(config))


#: What tpu-env puts into the spec (:func:`chips_only` leaves it out).
FROM_TPU_ENV = frozenset(
    {"TPU_SKIP_MDS_QUERY", "TPU_RUNTIME_METRICS_PORTS", *(n for n, _ in SHARED_KEYS + WHOLE_HOST_KEYS)}
)


def chips_only(spec: object) -> object:
    """``spec`` without what tpu-env put in it: what doctor compares with the chips bound now (the
    daemon rewrites the spec when tpu-env changes; a file edited since is not the chips' fault).
    A chip's one-chip bounds stay: they are the chip's, not tpu-env's."""
    if not isinstance(spec, dict):
        return spec
    copy = json.loads(json.dumps(spec))

    def strip(edits: object, chip: bool) -> None:
        if isinstance(edits, dict) and isinstance(edits.get("env"), list):
            kept = [
                e
                for e in edits["env"]
                if not isinstance(e, str)
                or e.partition("=")[0] not in FROM_TPU_ENV
                or (chip and e.partition("=")[0] in SELECTION_VARIABLES and e.endswith(f"={ONE_CHIP_BOUNDS}"))
            ]
            if chip:
                kept = [e for e in kept if e not in ONE_HOST]
            if kept:
                edits["env"] = kept
            else:
                del edits["env"]

    strip(copy.get("containerEdits"), chip=False)
    for device in copy.get("devices") or []:
        if isinstance(device, dict):
            strip(device.get("containerEdits"), chip=device.get("name") != ALL)
    return copy


def host_spec(root: Root, config: Config, binder: Binder) -> Spec | None:
    """The spec as the daemon keeps it, read from the host now (`tpuboot cdi`, doctor)."""
    extras = host_extras(root, config)
    log_dropped(extras.dropped)
    return render(current_chips(binder), extras, binder.table)


def devices_per_chip(chip: Chip, table: DeviceTable) -> int:
    """How many TPU devices libtpu counts on the chip (two on a TPU7x chip: GKE's plugin)."""
    kind = table.named(chip.kind)
    return 2 if kind is not None and "tpu7x" in kind.generations else 1


def metrics_ports(chips: Sequence[Chip], table: DeviceTable) -> list[list[int]]:
    """Each chip's TPU_RUNTIME_METRICS_PORTS: consecutive from METRICS_PORT, in chip order."""
    ports, port = [], METRICS_PORT
    for chip in chips:
        count = devices_per_chip(chip, table)
        ports.append(list(range(port, port + count)))
        port += count
    return ports


def _ports_env(ports: Sequence[int]) -> str:
    return "TPU_RUNTIME_METRICS_PORTS=" + ",".join(map(str, ports))


def _bind(host: str, container: str, *options: str) -> dict[str, object]:
    return {"hostPath": host, "containerPath": container, "options": [*options, "nosuid", "nodev", "bind"]}


def address_name(chip: Chip) -> str:
    """The chip's device name by address: its base address, ``-`` for ``:`` (the spec's grammar)."""
    return name_of(base_address(chip.functions[0].address))


def name_of(base: str) -> str:
    """The device name of the chip at base address ``base`` (dddd:bb:dd): ``dddd-bb-dd``."""
    return base.replace(":", "-")


def spec_chips(chips: Sequence[Chip]) -> list[Chip]:
    """The chips a container can be given: those with a node to open (a VFIO chip only while bound
    to vfio-pci, an accel chip once its driver made /dev/accelN)."""
    return [chip for chip in chips if chip.nodes]


def _nodes(paths: Sequence[str]) -> list[dict[str, str]]:
    return [{"path": path} for path in paths]


def chip_env(chip: Chip) -> list[str]:
    """What makes libtpu use this chip alone (the module doc gives the sources)."""
    return [f"TPU_VISIBLE_CHIPS={chip.index}"] + [f"{name}={ONE_CHIP_BOUNDS}" for name in SELECTION_VARIABLES]


def render(
    chips: Sequence[Chip], extras: Extras | None = None, table: DeviceTable | None = None
) -> Spec | None:
    """The spec for ``chips`` (those of :func:`spec_chips`); None when there is none (a CDI spec
    must list at least one device).

    Device nodes carry only their path: the runtime reads type and numbers from the node when the
    container starts, so a spec stays right while a node is recreated with the same group. What
    every device shares (the VFIO container, tpu-env's topology, the mounts) is in the spec's own
    edits, applied once whatever devices a container asks for (SPEC.md): a mount listed per device
    would be mounted twice for two of them.
    """
    extras = extras or Extras()
    usable = spec_chips(chips)
    if not usable:
        return None
    ports = metrics_ports(usable, table or DeviceTable())
    devices: list[dict[str, object]] = []
    for chip, own in zip(usable, ports, strict=True):
        env = chip_env(chip) + ([*ONE_HOST, _ports_env(own)] if extras.known else [])
        edits = {"env": env, "deviceNodes": _nodes(chip.nodes)}
        devices.append({"name": str(chip.index), "containerEdits": edits})
        devices.append({"name": address_name(chip), "containerEdits": edits})
    every = list(dict.fromkeys(node for chip in usable for node in chip.nodes))
    whole: dict[str, object] = {"deviceNodes": _nodes(every)}
    if extras.known:
        whole = {"env": [*extras.whole_host, _ports_env([p for own in ports for p in own])], **whole}
    devices.append({"name": ALL, "containerEdits": whole})
    spec: Spec = {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}
    shared: dict[str, object] = {}
    env = [*extras.shared, *([f"VBAR_CONTROL_SERVICE_URL={VBAR_URL}"] if extras.vbar else [])]
    if env:
        shared["env"] = env
    if any(chip.uses_vfio for chip in usable):
        shared["deviceNodes"] = _nodes([VFIO_CONTAINER])
    mounts = [_bind(TPU_LOGS_DIR, TPU_LOGS, "rw")]
    if extras.vbar:
        mounts.append(_bind(RELAY_DIR, PLUGIN_DIR, "ro", "noexec"))
    shared["mounts"] = mounts
    spec["containerEdits"] = shared
    return spec


def to_json(spec: Spec) -> bytes:
    """UTF-8 as it is, not \\u escapes: the engines' YAML parser refuses the surrogate pair JSON
    escapes a character beyond U+FFFF as (podman: "found invalid Unicode character escape code"),
    and with it every device of the spec."""
    return (json.dumps(spec, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def to_yaml(spec: Spec) -> bytes:
    """Plain YAML: each device's edits written out in full, never as anchors and aliases (a chip's
    two names share one edits object), which a reader of a file in /etc/cdi should not meet."""
    import yaml  # only `tpuboot cdi --format yaml` pays for PyYAML

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    text = yaml.dump(spec, Dumper=Plain, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return text.encode("utf-8")  # as to_json: characters as they are, no escapes to misread


@dataclass(frozen=True)
class _Seen:
    """What :func:`chips_present` needs of one function (a survey's record without its checks)."""

    address: str
    kind: str
    driver: str | None
    iommu_group: str | None


def current_chips(binder: Binder) -> list[Chip]:
    """The chips on the machine now, from sysfs (one source for the daemon, `tpuboot cdi` and
    doctor): each function's ids, driver and group, without the survey's viability checks, which
    the spec does not need and which would delay it after every bind."""
    seen = []
    for fn, kind in tpu_functions(binder.root, binder.table):
        try:
            seen.append(_Seen(fn.address, kind.name, fn.driver(), fn.iommu_group()))
        except OSError:  # removed while read, or unreadable: no chip a container could use
            continue
    return chips_present(binder.root, binder.table, seen)


def log_dropped(dropped: Mapping[str, str]) -> None:
    """One journal line for the tpu-env values the spec leaves out (none: nothing said)."""
    if dropped:
        said = "; ".join(f"{name} {why}" for name, why in dropped.items())
        log.warning(
            "CDI spec: tpu-env values left out (%s); containers get the rest", printable(said),
            extra={"CDI_SPEC": SPEC_PATH, "CDI_DROPPED": " ".join(dropped)})  # fmt: skip
