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
- ``all`` sets none: libtpu then sees the whole host, as it does outside a container.
- No tpu-env value: the DRA driver copies topology values into the container only with
  ``TPU_SKIP_MDS_QUERY=true``, because a GKE node's metadata is not the slice's. On a TPU VM a
  container reaches the same metadata server libtpu reads on the host, and a value frozen into the
  spec would go stale when tpu-env changes; ``docker run --env-file /run/tpuboot/tpu-env.docker``
  passes the file itself where a workload wants it.

Two per-chip devices in one container would set TPU_VISIBLE_CHIPS twice (CDI appends env):
request one chip or ``all``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpuboot.atomicfile import write_file
from tpuboot.devices.chips import VFIO_CONTAINER, Chip, base_address, chips_present
from tpuboot.devices.pci import PciFunction, list_addresses

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future

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

Spec = dict[str, object]


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


def render(chips: Sequence[Chip]) -> Spec | None:
    """The spec for ``chips`` (those of :func:`spec_chips`); None when there is none (a CDI spec
    must list at least one device).

    Device nodes carry only their path: the runtime reads type and numbers from the node when the
    container starts, so a spec stays right while a node is recreated with the same group.
    """
    usable = spec_chips(chips)
    if not usable:
        return None
    devices: list[dict[str, object]] = []
    for chip in usable:
        edits = {"env": chip_env(chip), "deviceNodes": _nodes(chip.nodes)}
        devices.append({"name": str(chip.index), "containerEdits": edits})
        devices.append({"name": address_name(chip), "containerEdits": edits})
    every = list(dict.fromkeys(node for chip in usable for node in chip.nodes))
    devices.append({"name": ALL, "containerEdits": {"deviceNodes": _nodes(every)}})
    spec: Spec = {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}
    if any(chip.uses_vfio for chip in usable):  # once, for any device asked for (SPEC.md)
        spec["containerEdits"] = {"deviceNodes": _nodes([VFIO_CONTAINER])}
    return spec


def to_json(spec: Spec) -> bytes:
    return (json.dumps(spec, indent=2) + "\n").encode()


def to_yaml(spec: Spec) -> bytes:
    """Plain YAML: each device's edits written out in full, never as anchors and aliases (a chip's
    two names share one edits object), which a reader of a file in /etc/cdi should not meet."""
    import yaml  # only `tpuboot cdi --format yaml` pays for PyYAML

    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    return yaml.dump(spec, Dumper=Plain, sort_keys=False, default_flow_style=False).encode()


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
    for address in list_addresses(binder.root):
        fn = PciFunction(binder.root, address)
        try:
            kind = binder.table.classify(fn.ids())
            if kind is not None:
                seen.append(_Seen(address, kind.name, fn.driver(), fn.iommu_group()))
        except OSError:  # removed while read, or unreadable: no chip a container could use
            continue
    return chips_present(binder.root, binder.table, seen)


def apply(root: Root, spec: Spec | None) -> bool:
    """Make the spec file hold ``spec`` (removed when None); True if anything changed."""
    if spec is not None:
        return write_file(root, SPEC_PATH, to_json(spec), mode=0o644)
    try:
        os.unlink(root.path(SPEC_PATH))
    except FileNotFoundError:
        return False
    return True


class SpecWriter:
    """The daemon's copy of the spec, refreshed after every change to the devices.

    :meth:`refresh` runs on the event loop and only hands the work to the worker pool (a read of
    sysfs and a file write: daemon.py's rule keeps both off the loop, as it keeps a bind's chmod);
    at most one refresh runs at a time, and one asked for meanwhile runs after it, so the last
    write always follows the last change. :meth:`stop` removes the file, and no write lands after
    it (the lock).
    """

    def __init__(
        self,
        binder: Binder,
        executor: Executor,
        call_soon_threadsafe: Callable[..., object],
    ) -> None:
        self.binder = binder
        self.executor = executor
        self._back = call_soon_threadsafe
        self._running = False
        self._again = False
        self._lock = threading.Lock()  # held by a write in the pool and by stop()
        self._stopped = False

    @property
    def writing(self) -> bool:
        """A refresh is running or asked for (the boot's last lands a little after READY)."""
        return self._running or self._again

    def refresh(self) -> None:
        """On the loop, within the turn of a device change."""
        if self._running:
            self._again = True
            return
        self._submit()

    def _submit(self) -> None:
        self._running, self._again = True, False
        try:
            future = self.executor.submit(self._write)
        except RuntimeError:  # the pool is shut down: the daemon is stopping
            self._running = False
            return
        future.add_done_callback(lambda f: self._back(self._done, f))

    def _write(self) -> bool:
        """In the pool: the spec of the chips present now, written (or removed: no chip)."""
        with self._lock:
            if self._stopped:
                return False
            return apply(self.binder.root, render(current_chips(self.binder)))

    def _done(self, future: Future[bool]) -> None:
        """Back on the loop."""
        self._running = False
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            log.error("CDI spec %s: %s", SPEC_PATH, exc, extra={"CDI_SPEC": SPEC_PATH})
        if self._again:
            self._submit()

    def stop(self) -> None:
        """At the daemon's stop: the spec goes, so no container is given a chip nobody keeps bound."""
        with self._lock:
            self._stopped = True
            try:
                apply(self.binder.root, None)
            except OSError as exc:
                log.warning("CDI spec %s not removed: %s", SPEC_PATH, exc, extra={"CDI_SPEC": SPEC_PATH})
