"""The one place that makes the daemon of `tpuboot run` from a root and a configuration.

In two halves, as the daemon runs them. :func:`build` makes what READY waits for, and only that:
coldplug first (tpuboot/devices/udev.py says why: the udev monitor is opened and the binds of the
TPUs present are submitted before the rest of the daemon is imported; the device manager adopts
them on the loop), then the boot parts (the CDI spec, tpu-env, the boot budget's READY mark) and
the metadata client they share with the later parts. :func:`after_boot` makes the rest (the
containers, the notices, the runtime collector, the guest attributes, recovery, vBar's relay, the
metrics endpoint); the daemon calls it right after READY=1 went out, so the boot neither imports
nor starts any of them. A part of the boot that a later part acts on is told of it then: tpu-env's
listeners gain the containers. The tests build the daemon here too, passing the seams below;
production passes none.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tpuboot.config import Config, GuestAttributesConfig, MetadataConfig, NoticesConfig, decided
from tpuboot.devices.table import DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.errors import ConfigError
from tpuboot.paths import Root

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Executor

    from tpuboot.bootbudget import BootBudget
    from tpuboot.component import Part
    from tpuboot.containers.engine import ContainerEngine
    from tpuboot.daemon import Daemon
    from tpuboot.devices.manager import DeviceManager, Monitor
    from tpuboot.env.service import EnvService
    from tpuboot.env.sync import EnvSync
    from tpuboot.eventloop import EventLoop
    from tpuboot.gce.client import MetadataClient
    from tpuboot.gce.guestattrs import PublisherSettings
    from tpuboot.gce.settings import MetadataSettings
    from tpuboot.metrics_server import MetricsServer
    from tpuboot.notices.service import NoticeSettings
    from tpuboot.notify import Notifier
    from tpuboot.runtime.collector import RuntimeCollector

log = logging.getLogger("tpuboot.wiring")


def build(
    root: Root,
    config: Config,
    *,
    binder: Binder | None = None,
    monitor: Monitor | None = None,
    notifier: Notifier | None = None,
    metadata: MetadataClient | None = None,
    engine: Callable[[], ContainerEngine] | None = None,
    loop: EventLoop | None = None,
    runtime: RuntimeCollector | None = None,
) -> Daemon:
    """The daemon with its boot parts, its binds of the TPUs present already running, and
    :func:`after_boot` to make the rest after READY. Seams (tests): ``binder`` (a fake kernel's),
    ``monitor`` (udev events), ``notifier`` (sd_notify), ``metadata`` (one client for every part),
    ``engine`` (a container engine's client factory), ``loop`` (one that counts its wake-ups),
    ``runtime`` (a collector whose holders and listeners the test names)."""
    binder = binder or Binder.of(root, config)
    from time import CLOCK_BOOTTIME, clock_gettime  # the boot budget's clock; its module comes later

    from tpuboot.devices.udev import new_executor, open_udev_monitor, start_coldplug

    if monitor is None:
        monitor = open_udev_monitor()  # before enumerating, so no device falls in between
    monitor_open = clock_gettime(CLOCK_BOOTTIME)
    executor = new_executor()
    coldplug = start_coldplug(binder, executor)
    enumerated = clock_gettime(CLOCK_BOOTTIME)

    # The boot parts' modules, beside the binds: the loop's first (bench/ stamps from it to the
    # end of the env sync's and the metadata client's).
    from tpuboot.daemon import Daemon

    # isort: split
    from tpuboot import bootbudget, metrics

    budget = bootbudget.begin(root)
    budget.mark(bootbudget.MONITOR_OPEN, at=monitor_open)
    budget.mark(bootbudget.COLDPLUG, f"{len(coldplug.addresses)} PCI functions", at=enumerated)
    from tpuboot.containers.agents import agents_enabled
    from tpuboot.containers.cdi import Extras, extras_of, relays_vbar
    from tpuboot.containers.cdi_file import SpecWriter
    from tpuboot.devices.manager import DeviceManager
    from tpuboot.env.service import EnvService
    from tpuboot.env.sync import EnvSync
    from tpuboot.eventloop import EventLoop
    from tpuboot.gce.client import MetadataClient
    from tpuboot.notify import Notifier

    loop = loop or EventLoop()  # the daemon's, run by Daemon.serve on the main thread
    publish = decided(config.guest_attributes.enabled) is not False
    containers_on = bool(agents_enabled(config))
    if metadata is None and (config.env.enabled or containers_on or publish or config.notices.enabled):
        try:
            settings = metadata_settings(config.metadata)
            metadata = MetadataClient.from_settings(settings, on_request=metrics.metadata_request)
        except ConfigError as exc:  # a bad $GCE_METADATA_HOST: tpu-env and the GKE check need it
            if config.env.enabled or (containers_on and config.gke == "auto"):
                raise
            # the TPUs are bound all the same; pulls go without the VM's token
            log.error("metadata: %s; no guest attributes, no registry token", exc)
            publish = False
    sync = EnvSync(root, config, metadata) if config.env.enabled and metadata is not None else None
    relay = relays_vbar(config)

    def extras() -> Extras:  # in the pool, at each write of the spec
        return extras_of(None if sync is None else sync.parsed_values(), relay)

    cdi = SpecWriter(binder, executor, loop.call_soon_threadsafe, extras)
    # The CDI spec follows every device change in the change's own turn of the loop.
    devices = DeviceManager(loop, binder, executor, monitor, coldplug, config.ready, follow=cdi.refresh)
    env = None
    if sync is not None:
        # After each tpu-env result (in the env thread), the spec is rewritten from the loop: its
        # topology may have changed. The containers listen too, once they run (after_boot).
        refresh = functools.partial(loop.call_soon_threadsafe, cdi.refresh)
        env = EnvService(sync, config.metadata.boot_deadline, config.metadata.watch, refresh)
    boot_budget = bootbudget.BootBudget(budget, executor.submit, metrics.boot_phases)
    # The boot parts, in STATUS's order: what READY waits for (the binds are the loop's own), each
    # started, ticked, observing and stopped in it (tpuboot/component.py). A new part READY must
    # wait for is its module and one line here; any other goes in after_boot's list.
    parts: list[Part | None] = [cdi, env, boot_budget]
    boot = [part for part in parts if part is not None]
    made = Boot(
        root, config, binder, executor, devices, metadata, publish, sync, env, boot_budget, engine, runtime
    )
    notifier = notifier or Notifier()
    return Daemon(loop, devices, executor, notifier, boot, metadata, functools.partial(after_boot, made))


@dataclass(frozen=True)
class Boot:
    """What :func:`build` made that the after-boot parts use."""

    root: Root
    config: Config
    binder: Binder
    executor: Executor
    devices: DeviceManager
    metadata: MetadataClient | None  # shared: the daemon closes it at stop
    publish: bool  # the guest attributes: asked for, and a client for them
    sync: EnvSync | None
    env: EnvService | None
    budget: BootBudget
    engine: Callable[[], ContainerEngine] | None  # the tests' seams
    runtime: RuntimeCollector | None


def after_boot(boot: Boot) -> list[Part]:
    """The parts READY does not wait for, made once READY=1 went out (the daemon calls this on its
    loop, and never when a stop came first): their modules are imported here, so the boot never
    loads them. In STATUS's order, after the boot parts: each is started, ticked (over the tick's
    one device snapshot), observes and is stopped in it; a new one is its module and one line here.
    The guest attributes' PCIe summary is ticked before recovery's resets; the containers stop
    after the metadata client closes, before vBar's relay and the metrics endpoint."""
    from tpuboot.containers.agents import agents_enabled
    from tpuboot.containers.cdi import relays_vbar
    from tpuboot.containers.service import Containers
    from tpuboot.derived import GuestAttributes, TpuVmGate, VbarMark
    from tpuboot.gce.guestattrs import Publisher
    from tpuboot.metrics_endpoint import MetricsEndpoint

    root, config, metadata, env = boot.root, boot.config, boot.metadata, boot.env
    containers = None
    if agents_enabled(config):
        # vBar's image comes from the tpu-env values the sync parsed, never from the file it wrote:
        # read when a container starts, and again after each tpu-env result from now on.
        if boot.sync is None:
            containers = Containers(config, root, metadata, boot.engine)
        else:
            containers = Containers(config, root, metadata, boot.engine, tpu_env=boot.sync.parsed_values)
        if env is not None:
            env.listen(containers.reconfigure)  # before it starts: no result falls in between
    vbar_relay = None
    if relays_vbar(config) and config.vbar.endpoint is not None:
        from tpuboot.containers.vbar_relay import VbarRelay

        vbar_relay = VbarRelay(root, config.vbar.endpoint)
    publisher = None
    if boot.publish and metadata is not None:
        deadline = config.metadata.boot_deadline
        publisher = Publisher(metadata, publisher_settings(config.guest_attributes), check_deadline=deadline)
    notices = None
    if config.notices.enabled and metadata is not None:
        from tpuboot.notices.service import Notices

        notices = Notices(root, metadata, notice_settings(config.notices))
    runtime = boot.runtime
    if not config.runtime_metrics.enabled:
        runtime = None
    elif runtime is None:
        from tpuboot.runtime.collector import RuntimeCollector

        runtime = RuntimeCollector(root, config)
    endpoint = None
    if config.metrics.enabled:
        endpoint = MetricsEndpoint(functools.partial(open_metrics, root, boot.binder.table, config, runtime))
    recovery = None
    if config.recovery.automatic:
        from tpuboot.devices.recovery import AutoRecovery
        from tpuboot.holders.report import blockers_of

        recovery = AutoRecovery(boot.binder, config.recovery.max_resets_per_hour, blockers_of(root))
    devices = boot.devices
    guest_attrs = None if publisher is None else GuestAttributes(publisher, devices, env, containers, notices)
    parts: list[Part | None] = [
        containers,
        notices,
        runtime,
        None if containers is None else TpuVmGate(containers, devices, env),
        None if containers is None else VbarMark(boot.budget, containers),
        guest_attrs,
        recovery,
        vbar_relay,
        endpoint,
    ]
    return [part for part in parts if part is not None]


def open_metrics(
    root: Root, table: DeviceTable, config: Config, runtime: RuntimeCollector | None = None
) -> MetricsServer | None:
    """The daemon's /metrics, with what is read at each scrape (PCIe health, the chips' holders,
    the runtime collector's last poll), never between scrapes; in the endpoint's own thread, so
    prometheus_client loads beside the boot."""
    from tpuboot import metrics_export

    metrics_export.watch_pcie(root, table)
    metrics_export.watch_holders(root, config)
    if runtime is not None:
        metrics_export.watch_runtime(runtime.snapshot)
    return metrics_export.serve(config.metrics)  # a busy port is a warning: the daemon runs on without


def metadata_settings(config: MetadataConfig) -> MetadataSettings:
    """The metadata client's settings from the config's ``metadata`` section (every caller's one way)."""
    from tpuboot.gce.settings import MetadataSettings

    return MetadataSettings(host=config.host, timeout=config.timeout, max_body=config.max_body)


def publisher_settings(config: GuestAttributesConfig) -> PublisherSettings:
    """The guest-attribute publisher's settings from the ``guest_attributes`` section."""
    from tpuboot.gce.guestattrs import PublisherSettings

    return PublisherSettings(enabled=decided(config.enabled), min_interval=config.min_interval)


def notice_settings(config: NoticesConfig) -> NoticeSettings:
    """The notice part's settings from the ``notices`` section, the hook user looked up now: a
    user the host does not have turns the hooks off (never to root), and the notices go on."""
    from tpuboot.notices.hooks import HookUser, hook_user
    from tpuboot.notices.service import NoticeSettings

    try:
        user, hooks = hook_user(config.hook_user), True
    except ValueError as exc:
        log.error("%s; no notice hooks run", exc)
        user, hooks = HookUser(), False
    return NoticeSettings(config.hooks_dir, config.hook_deadline, user, hooks=hooks)
