"""``tpuboot prepare-image``: the last step of an image build (a Packer provisioner, a cloud-init
``runcmd``), on the build VM after the package is installed, before the disk is captured.

Steps, in order, each one result line (PASS / FAIL / SKIP / WARN, a fix for FAIL and WARN):

1. the image checks, judged on the **next** boot (:data:`tpuboot.checks.image.NEXT_BOOT_CHECKS`:
   the command line update-grub will write, every installed kernel, limits, udev rules, the
   documented procedure's leftovers), since the build VM's own boot is not the image's;
2. ``service``: tpuboot.service is stopped (it would write tpu-env and its cache again, and on a
   TPU VM used as build VM start vBar) and must still be enabled, so the image's first boot
   starts it. Decided: stopped, not left running: nothing of this VM's may run on into capture;
3. ``containers``: the containers tpuboot started (label ``io.tpuboot.managed=1``) removed:
   a captured container would be another instance's, privileged;
4. ``pull-vbar`` / ``pull-telemetry`` (``pull-SECTION`` for each agent of
   :data:`tpuboot.containers.agents.AGENTS`): the images the first boot will run pulled into
   dockerd, so the first boot starts them without a registry round trip. vBar's is
   ``vbar.image``: on a TPU VM tpu-env may name another (``VBARCONTROL_AGENT_DOCKER_URL``), pulled then;
5. ``instance-state``: what belongs to this VM removed: the tpu-env cache (its record names this
   instance), the tpu-env files tpuboot wrote, ``/run/tpuboot``, tpuboot's node_exporter
   textfile. Kept, as image settings: /etc/environment and tpuboot's record of its lines there
   (``/var/lib/tpuboot/environment.lines``, which ``apt purge`` needs), the drop-ins.

With ``--root DIR`` (an image tree, not running) steps 2-4 are SKIP and the rest act on the tree.
Exit status 1 when any step FAILs: the pipeline stops before capturing a broken image.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

from tpuboot import subproc
from tpuboot.atomicfile import remove_file, remove_files_in
from tpuboot.checks.image import run_checks
from tpuboot.config import Config
from tpuboot.containers.agents import AGENTS, Agent
from tpuboot.containers.credentials import ANONYMOUS, ServiceAccountCredentials
from tpuboot.containers.engine import (
    MANAGED_LABEL,
    ContainerEngine,
    EngineError,
    EngineNotFound,
    EngineUnreachable,
)
from tpuboot.containers.hostengine import HOST_ENGINE
from tpuboot.env.cache import cache_path
from tpuboot.errors import LinkLoop, TpubootError, loop_fix
from tpuboot.metrics import TEXTFILE_NAME
from tpuboot.paths import Root
from tpuboot.references import ImageRefused, RegistryAllowlist
from tpuboot.verdicts import CheckResult, failed, passed, skipped, warned

log = logging.getLogger("tpuboot.prepare")

UNIT = "tpuboot.service"
RUNTIME_DIR = "/run/tpuboot"
SYSTEMD_RUNNING = "/run/systemd/system"  # sd_booted(): systemd is PID 1
NOT_RUNNING = "an image tree, not the running system"

Systemctl = Callable[..., str]
EngineFactory = Callable[[], ContainerEngine]


def _systemctl(*args: str) -> str:
    return subproc.run(["systemctl", *args], timeout=120.0)


class Preparer:
    """The steps of prepare-image against ``root``; ``systemctl`` and ``engine`` are seams for
    tests (the real ones run systemctl and talk to the host engine's socket under the root)."""

    def __init__(
        self,
        root: Root,
        config: Config,
        *,
        systemctl: Systemctl = _systemctl,
        engine: EngineFactory | None = None,
        live: bool | None = None,
        credentials: ServiceAccountCredentials | None = None,
        agents: Sequence[Agent] = AGENTS,
    ) -> None:
        """``live``: act on the running system (systemd, dockerd); default: when root is /.
        ``credentials``: the registry token for pulls, as the daemon sends it (none: anonymous)."""
        self.root = root
        self.live = root.is_host if live is None else live
        self.config = config
        self.systemctl = systemctl
        self.engine = engine or (lambda: HOST_ENGINE.open(root))
        self.credentials = credentials
        self.agents = tuple(agents)
        self._client: ContainerEngine | None = None
        self._engine_problem: str | None = None

    def run(self) -> list[CheckResult]:
        results = list(run_checks(self.root, next_boot=True))
        pulls = [(f"pull-{agent.section}", functools.partial(self.pull, agent)) for agent in self.agents]
        steps: list[tuple[str, Callable[[], CheckResult]]] = [
            ("service", self.service),
            ("containers", self.containers),
            *pulls,
            ("instance-state", self.instance_state),
        ]
        for name, step in steps:
            try:
                result = step()
            except LinkLoop as exc:  # the link to remove or mend, named (the path alone hides it)
                result = failed(exc.problem, f"{loop_fix(exc)}; then run tpuboot prepare-image again")
            except (OSError, TpubootError) as exc:
                result = failed(f"{exc}", "fix the cause above and run tpuboot prepare-image again")
            results.append(CheckResult(name, result.status, result.detail, result.fix))
        return results

    # ------------------------------------------------------------------ service

    def service(self) -> CheckResult:
        if not self.live:
            return skipped(NOT_RUNNING)
        if not self.root.path(SYSTEMD_RUNNING).is_dir():
            return skipped("systemd is not running here (a chroot or a container): nothing to stop")
        state = self.systemctl("show", "-P", "UnitFileState", UNIT).strip()
        if state not in ("enabled", "enabled-runtime", "static", "alias"):
            return failed(
                f"{UNIT} is {state or 'not installed'}: the image's first boot would not start it",
                f"systemctl enable {UNIT}",
            )
        active = self.systemctl("show", "-P", "ActiveState", UNIT).strip()
        if active in ("inactive", "failed"):
            return passed(f"{UNIT} {state}, not running")
        self.systemctl("stop", UNIT)
        return passed(f"{UNIT} stopped (was {active}); {state}: it starts at the image's first boot")

    # ------------------------------------------------------------------ the container engine

    def _engine(self) -> ContainerEngine | None:
        """The connected engine, or None with the reason in ``_engine_problem``."""
        if self._client is None and self._engine_problem is None:
            engine = self.engine()
            try:
                engine.connect()
            except EngineUnreachable as exc:
                self._engine_problem = f"{HOST_ENGINE.name} does not answer ({exc})"
            except EngineError as exc:
                self._engine_problem = f"{HOST_ENGINE.name}: {exc}"
            else:
                self._client = engine
        return self._client

    def containers(self) -> CheckResult:
        if not self.live:
            return skipped(NOT_RUNNING)
        engine = self._engine()
        if engine is None:
            return skipped(f"no container to remove: {self._engine_problem}")
        names = []
        for container in engine.list_managed():
            with contextlib.suppress(EngineNotFound):  # gone meanwhile
                engine.remove(container.ident)
            names.append(",".join(container.names) or container.ident[:12])
        if names:
            return passed(f"removed {', '.join(names)} (label {MANAGED_LABEL}=1; their images stay)")
        return passed(f"no container labelled {MANAGED_LABEL}=1")

    def pull(self, agent: Agent) -> CheckResult:
        """Pull the image the agent's first start will run (the configuration's: tpu-env is not
        this VM's to read for the image's)."""
        section, key = agent.settings(self.config), agent.section
        if not section.enabled:
            return skipped(f"{key}.enabled is false")
        runtime = agent.runtime_key(self.config)
        if runtime is not None:
            return skipped(f"{runtime}: no image")
        image = agent.container(self.config, self.root, None).image
        if self.config.gke == "true" and agent.gke_runs:
            return skipped("gke is true: GKE runs the agents itself")
        if not self.live:
            return skipped(f"{NOT_RUNNING}: pull {image} on the build VM (or {HOST_ENGINE.cli} load it)")
        try:
            RegistryAllowlist(section.registries, f"{key}.registries").check(image, f"{key}.image")
        except ImageRefused as exc:
            return failed(str(exc), f"set {key}.image to an allowed image, or extend {key}.registries")
        engine = self._engine()
        if engine is None:
            return failed(
                f"cannot pull {image}: {self._engine_problem}",
                f"install {HOST_ENGINE.package} and start {HOST_ENGINE.name} before prepare-image, "
                f"or set {key}.enabled: false",
            )
        creds = ANONYMOUS if self.credentials is None else self.credentials.for_image(image)
        try:
            engine.pull(image, creds.auth)
        except EngineError as exc:
            if not engine.has_image(image):
                return failed(
                    f"cannot pull {image}: {exc}{creds.advice(str(exc))}",
                    "make the registry reachable from the build VM (and its credentials), or "
                    f"`{HOST_ENGINE.cli} load` the image before prepare-image",
                )
            return warned(
                f"cannot pull {image} ({exc}); the copy {HOST_ENGINE.name} has will be used",
                "make the registry reachable to refresh it, if the tag moves",
            )
        return passed(f"pulled {image}")

    # ------------------------------------------------------------------ instance state

    def instance_state(self) -> CheckResult:
        env = self.config.env
        files = [cache_path(self.config), env.tpu_env_path, env.systemd_env_path, env.docker_env_path]
        if self.config.metrics.textfile_dir:
            files.append(self.config.metrics.textfile_dir.rstrip("/") + "/" + TEXTFILE_NAME)
        removed = [path for path in dict.fromkeys(f for f in files if f) if remove_file(self.root, path)]
        link = self.root.links_on(RUNTIME_DIR)
        if link is not None:
            return failed(
                f"{link} is a symbolic link; tpuboot empties no directory reached through one"
                + (f" (removed {', '.join(removed)})" if removed else ""),
                f"remove what is in {RUNTIME_DIR} by hand, or make {link} a directory",
            )
        removed += remove_files_in(self.root, RUNTIME_DIR)
        if removed:
            return passed("removed " + ", ".join(removed))
        return passed("no instance state (no tpu-env, no cache)")


def prepare(root: Root, config: Config) -> list[CheckResult]:
    """Every step's result (see the module's docstring). Pulls send the VM's service-account token
    to the registries that take it, as the daemon's do."""
    if not root.is_host:
        return Preparer(root, config).run()
    from tpuboot.gce.client import MetadataClient
    from tpuboot.wiring import metadata_settings

    try:
        client = MetadataClient.from_settings(metadata_settings(config.metadata), log_retries=False)
    except TpubootError as exc:  # a bad $GCE_METADATA_HOST: anonymous pulls, the rest as ever
        log.warning("metadata: %s; pulling without the VM's credentials", exc)
        return Preparer(root, config).run()
    try:
        credentials = ServiceAccountCredentials(client, config.registry_auth.token_registries)
        return Preparer(root, config, credentials=credentials).run()
    finally:
        client.close()
