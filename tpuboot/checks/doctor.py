"""`tpuboot doctor`: is this running TPU VM ready for a workload? One verdict per check.

The checks of GKE's OS image certification for TPU hosts (doc/operation.md, "What doctor holds a
host to") and tpuboot's own outputs, on the running system: every TPU bound to vfio-pci, vfio_pci loaded, the
/dev/vfio nodes' mode, allow_unsafe_interrupts where tpuboot sets it, the IOMMU groups viable,
tpu-env present, parseable and fresh, the GCS variables in /etc/environment
(:mod:`tpuboot.checks.tpuenv`), vBar and the telemetry
collector running (not on GKE), the number of usable chips the machine type or the slice implies,
the slice tpu-env describes (:mod:`tpuboot.slice.shape`) and this worker's identity in it as
``tpuboot slice`` judges it (:mod:`tpuboot.slice.identity`; the peer sweep, network I/O, stays
there). The image settings (kernel command line,
transparent huge pages, limits for logins and the container runtimes, the accel udev rule) are
:mod:`tpuboot.checks.image`'s checks, run as they are.

Everything goes through the injectable :class:`~tpuboot.paths.Root`; the metadata server through a
client (:class:`~tpuboot.gce.client.MetadataClient` or a test's), the docker socket through a
callable a test replaces. Each fact comes from the module that owns it: GKE detection from
:mod:`tpuboot.containers.gke` (the daemon's rule), the tpu-env cache from
:func:`tpuboot.env.cache.read_cache`, sysfs paths and fixes from :mod:`tpuboot.devices`. A check
that cannot be judged here is SKIP with the reason; WARN is a doubt that fails nothing (a TPU
generation tpuboot's table does not know).
Each check is declared by its :class:`~tpuboot.verdicts.Criterion` beside its code (this module's
own below, the others' in their modules): a FAIL of a required one makes the exit status
non-zero, an advisory one's is reported only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from tpuboot.checks.cdi import CdiChecks
from tpuboot.checks.containers import UNANSWERED, ContainerChecks, ContainerProbe, engine_container_state
from tpuboot.checks.holders import HolderChecks
from tpuboot.checks.image import image_checks
from tpuboot.checks.kernel import kernel_arch
from tpuboot.checks.notices import MAINTENANCE_NOTICE, check_notice
from tpuboot.checks.parsers.systemd import Systemd
from tpuboot.checks.pcie import PCIE_HEALTH, check_pcie_health
from tpuboot.checks.runtime import RuntimeChecks
from tpuboot.checks.tpuenv import TpuEnvChecks
from tpuboot.config import Config, MetadataConfig
from tpuboot.containers.liveness import EndpointProbe, probe
from tpuboot.devices.chips import chips_present
from tpuboot.devices.kmodule import NO_VFIO_PCI_FIX, module_state
from tpuboot.devices.pci import PCI_DEVICES
from tpuboot.devices.survey import TpuStatus, survey
from tpuboot.devices.table import generations_of_kind
from tpuboot.devices.vfio import (
    IOMMU_OFF_FIX,
    UNSAFE_INTERRUPTS,
    VFIO_PCI,
    VFIO_PCI_DRIVER,
    Binder,
    group_node,
    unsafe_interrupts_wanted,
    vfio_pci_registered,
)
from tpuboot.errors import MetadataError
from tpuboot.gce.client import MetadataClient
from tpuboot.gce.keys import MACHINE_TYPE
from tpuboot.gce.replies import MetadataAbsent, MetadataUnanswered, Reply
from tpuboot.paths import Root
from tpuboot.slice.facts import read_facts
from tpuboot.slice.identity import judge, one_check
from tpuboot.slice.shape import Reading, read_slice
from tpuboot.verdicts import CheckResult, Checks, Criterion, failed, holding_root, passed, skipped, warned
from tpuboot.wiring import metadata_settings

TPUS_BOUND = Criterion("tpus-bound", "every TPU that needs vfio-pci bound to it")
VFIO_LOADED = Criterion("vfio-pci-loaded", "vfio-pci in the running kernel: a loaded module, or built in")
NODE_MODE = Criterion("vfio-node-mode", "each bound TPU's /dev/vfio node of vfio.node_mode (0666)")
UNSAFE_INTERRUPTS_ON = Criterion(
    "unsafe-interrupts", "vfio_iommu_type1's allow_unsafe_interrupts on where tpuboot sets it (auto: x86_64)"
)
GROUPS_VIABLE = Criterion("iommu-groups-viable", "every TPU in an IOMMU group, and each group viable")
METADATA_SERVER = Criterion("metadata-server", "the metadata server answering (a value or a 404)")
CHIP_COUNT = Criterion(
    "chip-count", "as many usable chips as the machine type or slice puts on one host, of its generation"
)
SLICE = Criterion(
    "slice", "tpu-env's slice and the machine type agreeing with each other and with the TPU table"
)
SLICE_IDENTITY = Criterion(
    "slice-identity", "this worker's identity in its slice, as tpuboot slice judges it (no peer sweep)"
)


#: How long doctor waits for the metadata server, per key.
METADATA_DEADLINE = 2.0


class MetadataReader(Protocol):
    """What doctor asks of the metadata server: :meth:`MetadataClient.get`."""

    def get(self, path: str, *, deadline_s: float) -> Reply: ...


@dataclass(frozen=True)
class Verdict:
    """A check's result and whether a FAIL of it fails the doctor."""

    result: CheckResult
    required: bool

    def as_dict(self) -> dict[str, object]:
        return {**self.result.as_dict(), "required": self.required}


def metadata_lookup(config: MetadataConfig) -> MetadataClient:
    """The metadata client doctor asks on the host (:class:`Doctor` bounds and shares its waits);
    its failure is the metadata-server check's one line, not a retry log."""
    return MetadataClient.from_settings(metadata_settings(config), log_retries=False)


class NoServer:
    """The metadata server where there is none to ask: ``--root`` names another tree."""

    def get(self, path: str, *, deadline_s: float) -> Reply:
        raise MetadataError("not asked: the root is not this host")


class AskedOnce:
    """The metadata server as doctor asks it: each key within ``deadline_s``, and once the server has
    not answered, every later key fails at once with that error (doctor waits once, not per check).
    """

    def __init__(self, client: MetadataReader, deadline_s: float) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.down: MetadataError | None = None

    def get(self, path: str, *, deadline_s: float) -> Reply:
        if self.down is not None:
            raise self.down
        quiet = logging.getLogger("tpuboot.gce")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # a server that does not answer is the check's SKIP, not a warning
        try:
            return self.client.get(path, deadline_s=min(deadline_s, self.deadline_s))
        except MetadataAbsent:
            raise
        except MetadataError as exc:
            self.down = exc
            raise
        finally:
            quiet.setLevel(level)


class Doctor:
    """The doctor's own checks for one system; :meth:`run` adds imagecheck's."""

    def __init__(
        self,
        root: Root,
        config: Config,
        *,
        metadata: MetadataReader | None = None,
        container_state: ContainerProbe = engine_container_state,
        endpoint_probe: EndpointProbe = probe,
        now: Callable[[], float] = time.time,
        metadata_deadline: float = METADATA_DEADLINE,
        systemd: Systemd | None = None,
    ) -> None:
        self.root = root
        self.config = config
        self.metadata = AskedOnce(metadata or NoServer(), metadata_deadline)
        self.container_state = container_state
        self.now = now
        self.systemd = systemd  # who answers the image checks' ``systemctl show`` (None: systemctl)
        self.binder = Binder.of(root, config)
        self.tpu_env = TpuEnvChecks(root, config, now)
        self._tpus: list[TpuStatus] | None = None
        self._slice: Reading | None = None
        holders = HolderChecks(
            root, config, lambda: chips_present(root, self.binder.table, self.tpus), systemd
        )
        devices = [
            (TPUS_BOUND, self.check_tpus_bound),
            (VFIO_LOADED, self.check_vfio_loaded),
            (NODE_MODE, self.check_node_mode),
            (UNSAFE_INTERRUPTS_ON, self.check_unsafe_interrupts),
            (GROUPS_VIABLE, self.check_groups_viable),
            (PCIE_HEALTH, lambda: check_pcie_health(self.root, self.tpus)),
            (METADATA_SERVER, self.check_metadata_server),
            (CHIP_COUNT, self.check_chip_count),
            (SLICE, self.check_slice),
            (SLICE_IDENTITY, self.check_slice_identity),
        ]
        containers = ContainerChecks(
            root, config, self.metadata, container_state, endpoint_probe=endpoint_probe
        )
        outputs = [
            *self.tpu_env.named(),
            *containers.named(),
            *holders.named(),
            *CdiChecks(root, self.binder, config=config).named(),  # containers without --privileged
            (MAINTENANCE_NOTICE, lambda: check_notice(self.root, self.config)),
        ]
        self.checks = Checks(
            [
                *holding_root(devices),
                *image_checks(systemd=systemd).table,  # the image settings, as image-check judges them
                *holding_root(outputs),
                *RuntimeChecks(root, config).named(),  # what the daemon last read of the jobs' libtpu
            ]
        )

    def run(self) -> list[Verdict]:
        """Every check, in the table's order; each result named, and required unless its criterion
        is advisory."""
        required = {criterion.name: criterion.required for criterion in self.checks.criteria}
        return [Verdict(r, required[r.name]) for r in self.checks.run(self.root)]

    # --- devices -------------------------------------------------------------------------------

    @property
    def tpus(self) -> list[TpuStatus]:
        if self._tpus is None:
            self._tpus = survey(self.binder)
        return self._tpus

    @property
    def managed(self) -> list[TpuStatus]:
        return [t for t in self.tpus if t.managed]

    def _no_sysfs(self) -> bool:
        return not self.root.path(PCI_DEVICES).is_dir()

    def check_tpus_bound(self) -> CheckResult:
        if self._no_sysfs():
            return skipped("no /sys/bus/pci: not a running system")
        if not self.managed:
            return skipped("no TPU that needs vfio-pci on this machine")
        unbound = [t for t in self.managed if t.driver != VFIO_PCI]
        if not unbound:
            return passed(f"{len(self.managed)} of {len(self.managed)} TPUs bound to vfio-pci")
        which = ", ".join(f"{t.address} ({t.driver or 'no driver'})" for t in unbound)
        addresses = " ".join(t.address for t in unbound)
        return failed(
            f"{len(unbound)} of {len(self.managed)} TPUs not bound to vfio-pci: {which}",
            f"tpuboot bind {addresses} (or systemctl restart tpuboot); journalctl -u tpuboot says why",
        )

    def check_vfio_loaded(self) -> CheckResult:
        """vfio-pci in the running kernel: loaded as a module (Debian) or built in (Ubuntu, where
        lsmod and /proc/modules never list it, and there is nothing to load)."""
        if not self.root.path("/sys/module").is_dir():
            return skipped("no /sys/module: not a running system")
        state = module_state(self.root, VFIO_PCI)
        if state.origin == "built-in":
            return passed(f"vfio-pci is built into {state.kernel} ({state.evidence}); lsmod does not list it")
        if state.origin == "loaded":
            return passed(f"vfio_pci is loaded as a module ({state.evidence})")
        if vfio_pci_registered(self.root):
            return passed(f"the vfio-pci driver is registered ({VFIO_PCI_DRIVER})")
        if state.origin == "absent":
            return failed(f"{state.kernel} has no vfio-pci: {state.evidence}", NO_VFIO_PCI_FIX)
        return failed("vfio_pci is not loaded", "modprobe vfio-pci (tpuboot loads it when it binds a TPU)")

    def check_node_mode(self) -> CheckResult:
        want = self.config.vfio.node_mode
        grouped = [
            (t, t.iommu_group) for t in self.managed if t.iommu_group is not None and t.driver == VFIO_PCI
        ]
        if not grouped:
            return skipped("no TPU bound to vfio-pci: no /dev/vfio node to check")
        wrong = []
        for t, group in grouped:
            if t.node is None:
                wrong.append(f"{group_node(group)} missing")
            elif t.node_mode is None or int(t.node_mode, 8) != want:
                wrong.append(f"{t.node} mode {t.node_mode}")
        nodes = sorted({group_node(group) for _, group in grouped})
        if not wrong:
            return passed(f"{', '.join(nodes)} mode {want:04o}")
        return failed(
            f"{'; '.join(wrong)}, not {want:04o}",
            f"chmod {want:o} {' '.join(nodes)} (or systemctl restart tpuboot, which sets it)",
        )

    def check_unsafe_interrupts(self) -> CheckResult:
        machine, setting = kernel_arch(self.root), self.config.vfio.allow_unsafe_interrupts
        if not unsafe_interrupts_wanted(setting, machine):
            return skipped(f"vfio.allow_unsafe_interrupts is {setting}: tpuboot does not set it on {machine}")
        path = self.root.path(UNSAFE_INTERRUPTS)
        if not path.exists():
            if not self.root.path("/sys/module").is_dir():
                return skipped("no /sys/module: not a running system")
            return failed(
                "vfio_iommu_type1 is not loaded",
                f"modprobe vfio_iommu_type1 && echo 1 > {UNSAFE_INTERRUPTS} (tpuboot bind does both)",
            )
        value = path.read_text().strip()
        if value in ("Y", "1"):
            return passed("vfio_iommu_type1 allow_unsafe_interrupts=Y")
        return failed(
            f"vfio_iommu_type1 allow_unsafe_interrupts={value}",
            f"echo 1 > {UNSAFE_INTERRUPTS} (tpuboot bind does it)",
        )

    def check_groups_viable(self) -> CheckResult:
        if not self.managed:
            return skipped("no TPU that needs vfio-pci on this machine")
        no_group = [t.address for t in self.managed if t.iommu_group is None]
        if no_group:
            return failed(
                f"no IOMMU group for {', '.join(no_group)}: the IOMMU is off",
                IOMMU_OFF_FIX,
            )
        blocked = [t for t in self.managed if t.viable is False]
        if not blocked:
            groups = sorted({t.iommu_group for t in self.managed if t.iommu_group}, key=int)
            return passed(f"IOMMU group{'s' if len(groups) > 1 else ''} {', '.join(groups)} viable")
        return failed(
            "; ".join(t.problem or f"group {t.iommu_group} not viable" for t in blocked),
            "bind every endpoint of the group to vfio-pci (tpuboot bind --force DBDF) or unbind it",
        )

    def _lookup(self, path: str) -> str | None:
        """A metadata value; None if absent, if the server does not answer (``metadata.down`` says
        why) or if it is not text."""
        try:
            return self.metadata.get(path, deadline_s=self.metadata.deadline_s).text
        except MetadataError:
            return None

    @property
    def slice(self) -> Reading:
        """This host's slice, from the machine type and tpu-env (read once)."""
        if self._slice is None:
            self._slice = read_slice(self.tpu_env.values, self._lookup(MACHINE_TYPE))
        return self._slice

    def check_metadata_server(self) -> CheckResult:
        """The metadata server answers (a value or a 404): said once here, and only named by the
        checks that need it (chip-count, slice, vbar-running, vbar-endpoint)."""
        if isinstance(self.metadata.client, NoServer):
            return skipped("not asked: --root names another tree, not this host")
        machine = self._lookup(MACHINE_TYPE)
        down = self.metadata.down
        if down is None:
            return passed(f"answers (machine type {machine.rsplit('/', 1)[-1] if machine else 'not set'})")
        if isinstance(down, MetadataUnanswered):
            return failed(f"metadata server unreachable: {down.url}: {down.reason}", down.fix)
        return failed(
            f"metadata server answers unusably: {down}",
            "point metadata.host or $GCE_METADATA_HOST at the GCE metadata server (or unset them)",
        )

    def _nothing_known(self) -> str:
        asked = f" ({UNANSWERED})" if self.metadata.down else ""
        return f"no TPU machine type{asked} and no accelerator type in tpu-env"

    def check_chip_count(self) -> CheckResult:
        """The TPU chips usable here (functions grouped into chips, as tpu-info counts them; a chip
        is usable when all its functions are present and usable): as many as the machine type or slice puts on
        one host, and of the generation it names."""
        found = self.slice.slice
        if found is None or found.host_chips is None:
            if self.slice.warnings:
                return skipped(f"the generation is not in tpuboot's TPU table (see the {SLICE.name} check)")
            return skipped(self._nothing_known())
        want, source = found.host_chips, found.host_chips_from
        ready = {
            t.address for t in self.tpus if (t.driver == VFIO_PCI if t.managed else t.driver is not None)
        }
        chips = chips_present(self.root, self.binder.table, self.tpus)
        usable = [c for c in chips if c.complete and all(fn.address in ready for fn in c.functions)]
        other = sorted({t.kind for t in self.tpus if found.generation.key not in generations_of_kind(t.kind)})
        other = [k for k in other if generations_of_kind(k)]  # a configured kind can be anything
        if other:
            return failed(
                f"{', '.join(other)} present; {found.named_by} is {found.generation.kind}",
                "tpu-env or the machine type describes another VM: recreate the VM, or correct the tpu-env "
                "instance attribute, then tpuboot env",
            )
        shape = f" ({found.hosts} hosts of {want} chips)" if found.hosts and found.hosts > 1 else ""
        functions = f", {len(self.tpus)} PCI functions" if len(self.tpus) != len(chips) else ""
        if len(usable) == want:
            return passed(f"{want} chips usable, as {source} implies{shape}")
        return failed(
            f"{len(usable)} chips usable ({len(chips)} present{functions}), {source} implies {want}{shape}",
            "tpuboot status shows each chip; a missing chip is a host problem: recreate or repair the VM",
        )

    def check_slice(self) -> CheckResult:
        """tpu-env's ACCELERATOR_TYPE, TOPOLOGY, CHIPS_PER_HOST_BOUNDS, HOST_BOUNDS and WORKER_ID,
        and the machine type, agree with each other and with the TPU table."""
        reading = self.slice
        if reading.problems:
            return failed("; ".join(p.what for p in reading.problems), reading.problems[0].fix)
        if reading.warnings:
            return warned("; ".join(reading.warnings))
        found = reading.slice
        if found is None:
            return skipped(self._nothing_known())
        parts = [found.accelerator or found.named_by]
        if found.chips is not None:
            parts.append(f"{found.chips} chips" + (f" in {found.topology}" if found.topology else ""))
        if found.hosts is not None and found.host_chips is not None:
            many = f"{found.hosts} hosts" if found.hosts > 1 else "1 host"
            parts.append(f"{many} of {found.host_chips} chips")
        if found.worker is not None:
            parts.append(f"this host is worker {found.worker}")
        return passed(", ".join(parts))

    def check_slice_identity(self) -> CheckResult:
        """Who this worker is in its slice, judged as ``tpuboot slice`` judges it (worker-id,
        worker-list, own-address, multislice: tpuboot/slice/identity.py); the peer sweep is network
        I/O, left to ``tpuboot slice``. tpu-env's own trouble is the tpu-env check's."""
        try:
            facts = read_facts(
                self.metadata, self.root, self.config.env.tpu_env_path, deadline_s=self.metadata.deadline_s
            )
        except MetadataError:
            return skipped(f"{UNANSWERED}: no worker list to judge")
        identity = judge(facts)
        return one_check(replace(identity, findings=[f for f in identity.findings if f.name != "tpu-env"]))


def failed_required(verdicts: list[Verdict]) -> bool:
    return any(v.required and v.result.status == "FAIL" for v in verdicts)
