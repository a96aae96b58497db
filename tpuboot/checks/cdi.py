"""Doctor's container checks: the CDI spec on disk is the bound chips', each installed engine reads
it, and its containers may lock the memory VFIO pins.

Which engine reads CDI, and from when (the consumers tpuboot's VM tests run):

- Docker: from Engine 25, behind ``"features": {"cdi": true}`` in /etc/docker/daemon.json; on by
  default from 28.2 (moby/moby #49963). ``cdi-spec-dirs`` there replaces the directories read.
- podman: always (4.x and later), from /etc/cdi and /var/run/cdi, or containers.conf's
  ``cdi_spec_dirs``.
- containerd: from 1.7 with ``enable_cdi = true`` in the CRI plugin's table of
  /etc/containerd/config.toml (``[plugins."io.containerd.grpc.v1.cri"]``); on by default from
  2.0 (``[plugins."io.containerd.cri.v1.runtime"]``). ``cdi_spec_dirs`` beside it. Only its CRI
  clients (kubelet, crictl) depend on it; Docker, which runs its containers on containerd, reads
  the spec itself: so a containerd that will not read it is a WARN, not a FAIL.

Memlock: CDI carries no rlimits. A container without CAP_IPC_LOCK (any unprivileged one) may pin
only RLIMIT_MEMLOCK bytes for VFIO's DMA mappings; it inherits the limit of the engine that starts
it (docker.service and containerd.service: the image checks ``docker-limits`` and
``containerd-limits`` judge their LimitMEMLOCK, which tpuboot's drop-ins set) unless the engine
sets its own default: Docker's ``default-ulimits`` in daemon.json, podman's ``default_ulimits`` in
containers.conf. Those are judged here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tpuboot.atomicfile import read_file
from tpuboot.checks.limits import CONTAINERD_LIMITS, DOCKER_LIMITS
from tpuboot.config import Config
from tpuboot.containers.cdi import (
    PLUGIN_DIR,
    RELAY_DIR,
    RELAY_SOCKET,
    SPEC_DIR,
    SPEC_PATH,
    VBAR_URL,
    chips_only,
    host_spec,
    relays_vbar,
)
from tpuboot.containers.hostengine import DOCKER
from tpuboot.devices.pci import PCI_DEVICES
from tpuboot.devices.vfio import Binder
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, failed, passed, skipped, warned

DAEMON_JSON = "/etc/docker/daemon.json"
CONTAINERD_TOML = "/etc/containerd/config.toml"
#: podman's containers.conf, in the order read (a later one wins).
CONTAINERS_CONF = ("/usr/share/containers/containers.conf", "/etc/containers/containers.conf")
PODMAN = ("/usr/bin/podman",)
CONTAINERD = ("/usr/bin/containerd", "/usr/sbin/containerd", "/usr/local/bin/containerd")
DOCKER_CDI_FIRST, DOCKER_CDI_DEFAULT = (25, 0), (28, 2)
CONTAINERD_CDI_FIRST, CONTAINERD_CDI_DEFAULT = (1, 7), (2, 0)
CRI_TABLES = (("plugins", "io.containerd.grpc.v1.cri"), ("plugins", "io.containerd.cri.v1.runtime"))
LIFT_MEMLOCK = "--ulimit memlock=-1:-1"
#: How long a probe's connection through the vBar relay must stay open for vBar to count as reached.
RELAY_WAIT = 1.0

#: ``version_of(path)``: the version a program prints (``dockerd --version``), None if unknown.
VersionOf = Callable[[str], "str | None"]

CDI_SPEC = Criterion("cdi-spec", f"{SPEC_PATH} describing the chips bound now (absent with none)")
# A host whose engines cannot give a container the chips without --privileged is still ready for
# the documented (privileged) workloads: the checks below say so without failing the doctor.
CDI_DOCKER = Criterion("cdi-docker", f"dockerd reading CDI specs from {SPEC_DIR}", required=False)
CDI_PODMAN = Criterion("cdi-podman", f"podman reading CDI specs from {SPEC_DIR}", required=False)
CDI_CONTAINERD = Criterion(
    "cdi-containerd", f"containerd's CRI plugin reading CDI specs from {SPEC_DIR}", required=False
)
CONTAINER_MEMLOCK = Criterion(
    "container-memlock", "no engine default lowering memlock for its containers", required=False
)
VBAR_RELAY = Criterion(
    "vbar-relay", "vBar reachable from containers through the socket tpuboot relays", required=False
)


def run_version(path: str) -> str | None:
    from tpuboot.errors import TpubootError
    from tpuboot.subproc import run

    try:
        return run([path, "--version"], timeout=10.0)
    except TpubootError:
        return None


def parse_version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of the first ``N.N`` in ``text``: ``Docker version 26.1.5+dfsg1`` -> (26, 1)."""
    match = re.search(r"(?<![\w.])v?([0-9]{1,9})\.([0-9]{1,9})", text or "")
    return (int(match[1]), int(match[2])) if match else None


# --- just enough TOML: Python 3.10 has no tomllib -------------------------------------------------


def _strip_comment(line: str) -> str:
    quote = ""
    for i, c in enumerate(line):
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def _header(text: str) -> tuple[str, ...]:
    """``plugins."io.containerd.grpc.v1.cri"`` -> ("plugins", "io.containerd.grpc.v1.cri")."""
    return tuple(part.strip().strip("\"'") for part in re.findall(r"\"[^\"]*\"|'[^']*'|[^.]+", text))


def _value(text: str) -> object:
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith("["):
        return [s[1:-1] for s in re.findall(r"\"[^\"]*\"|'[^']*'", text)]
    if text[:1] in "\"'":
        return text[1:-1]
    return text


def toml_values(text: str) -> Iterator[tuple[tuple[str, ...], str, object]]:
    """(table, key, value) of every ``key = value`` of a TOML file: booleans, strings and arrays of
    strings (an array may span lines); anything else as its text."""
    table: tuple[str, ...] = ()
    pending = ""
    for raw in text.splitlines():
        line = _strip_comment(raw).strip()
        if pending:
            pending += " " + line
            if pending.count("[") > pending.count("]"):
                continue
            line, pending = pending, ""
        if not line:
            continue
        if line.startswith("[") and "=" not in line:
            table = _header(line.strip("[]"))
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if value.count("[") > value.count("]"):
            pending = line
            continue
        yield table, key.strip().strip("\"'"), _value(value)


# --- the checks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    name: str
    version: tuple[int, int] | None


class CdiChecks:
    """The checks of one system; ``version_of`` runs a program's --version (tests pass theirs)."""

    def __init__(
        self,
        root: Root,
        binder: Binder,
        version_of: VersionOf | None = None,
        config: Config | None = None,
        relay_wait: float = RELAY_WAIT,
    ) -> None:
        self.root = root
        self.binder = binder
        self.version_of = version_of or (run_version if root.is_host else (lambda path: None))
        self.config = config or Config()
        self.relay_wait = relay_wait

    def named(self) -> list[tuple[Criterion, Callable[[], CheckResult]]]:
        return [
            (CDI_SPEC, self.check_spec),
            (CDI_DOCKER, self.check_docker),
            (CDI_PODMAN, self.check_podman),
            (CDI_CONTAINERD, self.check_containerd),
            (CONTAINER_MEMLOCK, self.check_memlock),
            (VBAR_RELAY, self.check_vbar_relay),
        ]

    def _text(self, path: str) -> str | None:
        data = read_file(self.root, path)
        return None if data is None else data.decode()

    def _installed(self, paths: tuple[str, ...]) -> str | None:
        return next((p for p in paths if self.root.path(p).exists()), None)

    def _engine(self, name: str, paths: tuple[str, ...]) -> Engine | None:
        path = self._installed(paths)
        return None if path is None else Engine(name, parse_version(self.version_of(path)))

    # --- the spec

    def check_spec(self) -> CheckResult:
        if not self.root.path(PCI_DEVICES).is_dir():
            return skipped("no /sys/bus/pci: not a running system")
        want = host_spec(self.root, self.config, self.binder)
        text = self._text(SPEC_PATH)
        regenerate = "systemctl restart tpuboot (it keeps the spec); journalctl -u tpuboot says why not"
        if want is None:
            if text is None:
                return passed(f"no chip to give a container, and no {SPEC_PATH}")
            return failed(f"{SPEC_PATH} describes chips not bound now", f"rm {SPEC_PATH}; {regenerate}")
        if text is None:
            return failed(f"no {SPEC_PATH}: containers cannot ask for google.com/tpu", regenerate)
        try:
            have = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested deep
            return failed(f"{SPEC_PATH} is not JSON ({exc})", regenerate)
        if chips_only(have) != chips_only(want):
            return failed(f"{SPEC_PATH} differs from the chips bound now (see tpuboot cdi)", regenerate)
        names = [str(d["name"]) for d in want["devices"]]  # type: ignore[attr-defined]
        return passed(f"{SPEC_PATH}: google.com/tpu={', '.join(names)}")

    # --- vBar through the relay

    def check_vbar_relay(self) -> CheckResult:
        """What a container's libtpu does first: connect to the relay socket, which connects to
        vBar; vBar down, the relay closes the connection at once (tpuboot/containers/vbar_relay.py)."""
        endpoint = self.config.vbar.endpoint
        if not relays_vbar(self.config) or endpoint is None:
            return skipped("tpuboot relays no vBar to containers (vbar off, no vbar.endpoint, or gke: true)")
        if not self.root.is_host and not self.root.path(RELAY_DIR).exists():
            return skipped(f"no {RELAY_DIR} in this tree: no tpuboot serves it")
        fix = f"systemctl restart tpuboot; journalctl -u tpuboot -g 'vBar' says why (vBar at {endpoint})"
        problem = probe_relay(self.root, self.relay_wait)
        if problem is not None:
            return failed(f"a container could not reach vBar: {problem}", fix)
        return passed(f"{VBAR_URL} ({RELAY_SOCKET} mounted at {PLUGIN_DIR}) reaches vBar at {endpoint}")

    # --- the engines

    def _daemon_json(self) -> dict[str, object] | CheckResult:
        text = self._text(DAEMON_JSON)
        if text is None:
            return {}
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return failed(f"{DAEMON_JSON} is not JSON ({exc})", f"fix {DAEMON_JSON}: dockerd refuses it")
        return value if isinstance(value, dict) else {}

    def check_docker(self) -> CheckResult:
        engine = self._engine(DOCKER.name, DOCKER.binaries)
        if engine is None:
            return skipped("Docker is not installed")
        config = self._daemon_json()
        if isinstance(config, CheckResult):
            return config
        if engine.version is None:
            return warned("dockerd's version is unknown: cannot tell whether it reads CDI specs")
        version = _dotted(engine.version)
        if engine.version < DOCKER_CDI_FIRST:
            return failed(
                f"Docker {version} does not read CDI specs (Docker 25 is the first)",
                "install Docker 25 or later (Debian 13's docker.io is 26), or use podman",
            )
        features = config.get("features")
        flag = features.get("cdi") if isinstance(features, dict) else None
        enable = f'set "features": {{"cdi": true}} in {DAEMON_JSON}, then systemctl restart docker'
        if flag is False or (flag is None and engine.version < DOCKER_CDI_DEFAULT):
            return failed(f"Docker {version} has its CDI feature off", enable)
        dirs = config.get("cdi-spec-dirs")
        if isinstance(dirs, list) and not _reads_spec_dir(dirs):
            return failed(
                f"{DAEMON_JSON} cdi-spec-dirs ({', '.join(map(str, dirs))}) leaves out {SPEC_DIR}",
                f"add {SPEC_DIR} to cdi-spec-dirs in {DAEMON_JSON}, then systemctl restart docker",
            )
        how = "feature cdi on" if flag else "on by default"
        return passed(f"Docker {version} reads CDI specs ({how})")

    def _containers_conf(self) -> dict[str, object]:
        """podman's [engine]/[containers] settings, later files winning."""
        found: dict[str, object] = {}
        for path in CONTAINERS_CONF:
            text = self._text(path)
            for table, key, value in toml_values(text or ""):
                found[".".join((*table, key))] = value
        return found

    def check_podman(self) -> CheckResult:
        engine = self._engine("podman", PODMAN)
        if engine is None:
            return skipped("podman is not installed")
        dirs = self._containers_conf().get("engine.cdi_spec_dirs")
        if isinstance(dirs, list) and not _reads_spec_dir(dirs):
            return failed(
                f"containers.conf cdi_spec_dirs ({', '.join(map(str, dirs))}) leaves out {SPEC_DIR}",
                f"add {SPEC_DIR} to cdi_spec_dirs in /etc/containers/containers.conf",
            )
        version = "" if engine.version is None else f" {_dotted(engine.version)}"
        return passed(f"podman{version} reads CDI specs from {SPEC_DIR}")

    def check_containerd(self) -> CheckResult:
        """containerd's enable_cdi serves its CRI clients alone (kubelet, crictl): Docker reads the
        spec itself, so a containerd without it is a WARN, and one whose CRI plugin is off a SKIP."""
        engine = self._engine("containerd", CONTAINERD)
        if engine is None:
            return skipped("containerd is not installed")
        values = list(toml_values(self._text(CONTAINERD_TOML) or ""))
        disabled = next((v for table, key, v in values if table == () and key == "disabled_plugins"), [])
        if isinstance(disabled, list) and {"cri", CRI_TABLES[0][1]} & set(disabled):
            return skipped(
                f"containerd's CRI plugin is disabled in {CONTAINERD_TOML}: no CRI client to serve"
            )
        if engine.version is None:
            return warned("containerd's version is unknown: cannot tell whether its CRI reads CDI specs")
        version = _dotted(engine.version)
        if engine.version < CONTAINERD_CDI_FIRST:
            return warned(
                f"containerd {version}'s CRI does not read CDI specs (1.7 is the first)",
                "install containerd 1.7 or later for Kubernetes pods (Docker reads the spec itself)",
            )
        settings = {key: value for table, key, value in values if table in CRI_TABLES}
        if settings.get("enable_cdi", engine.version >= CONTAINERD_CDI_DEFAULT) is not True:
            return warned(
                f"containerd {version} has enable_cdi off: its CRI clients (kubelet) get no TPU",
                f'set enable_cdi = true under [plugins."io.containerd.grpc.v1.cri"] in {CONTAINERD_TOML}, '
                "then systemctl restart containerd",
            )
        dirs = settings.get("cdi_spec_dirs")
        if isinstance(dirs, list) and not _reads_spec_dir(dirs):
            return failed(
                f"{CONTAINERD_TOML} cdi_spec_dirs ({', '.join(map(str, dirs))}) leaves out {SPEC_DIR}",
                f"add {SPEC_DIR} to cdi_spec_dirs in {CONTAINERD_TOML}, then systemctl restart containerd",
            )
        return passed(f"containerd {version} reads CDI specs for its CRI clients (enable_cdi)")

    # --- memlock

    def _docker_memlock(self) -> str | None:
        """daemon.json's default memlock when it is not unlimited, as ``soft:hard``."""
        config = self._daemon_json()
        ulimits = config.get("default-ulimits") if isinstance(config, dict) else None
        memlock = ulimits.get("memlock") if isinstance(ulimits, dict) else None
        if not isinstance(memlock, dict) or (memlock.get("Soft") == -1 and memlock.get("Hard") == -1):
            return None
        return f"{memlock.get('Soft')}:{memlock.get('Hard')}"

    def _podman_memlock(self) -> list[str]:
        """containers.conf's default_ulimits entries that limit memlock."""
        ulimits = self._containers_conf().get("containers.default_ulimits")
        entries = [str(u) for u in ulimits] if isinstance(ulimits, list) else []
        return [u for u in entries if u.startswith("memlock=") and u != "memlock=-1:-1"]

    def check_memlock(self) -> CheckResult:
        problems, fixes = [], []
        if self._installed(DOCKER.binaries) is not None and (docker := self._docker_memlock()) is not None:
            problems.append(f"{DAEMON_JSON} default-ulimits memlock is {docker}")
            fixes.append(f'"memlock": {{"Name": "memlock", "Soft": -1, "Hard": -1}} there, or {LIFT_MEMLOCK}')
        if self._installed(PODMAN) is not None and (podman := self._podman_memlock()):
            problems.append(f"containers.conf default_ulimits sets {', '.join(podman)}")
            fixes.append("memlock=-1:-1 (or none) in /etc/containers/containers.conf")
        if problems:
            return failed("; ".join(problems) + ": VFIO cannot pin a TPU's memory", "; ".join(fixes))
        if self._installed(DOCKER.binaries) is None and self._installed(PODMAN) is None:
            return skipped("neither Docker nor podman is installed")
        return passed(
            "no engine default lowers memlock: containers inherit the engine's limit "
            f"({DOCKER_LIMITS.name}, {CONTAINERD_LIMITS.name}; podman: the caller's)"
        )


def probe_relay(root: Root, wait: float) -> str | None:
    """Why a connection through the relay socket does not reach vBar (None: it does)."""
    import os
    import select
    import socket

    try:
        fd = os.open(root.path(RELAY_DIR), os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        return f"no {RELAY_DIR} ({exc.strerror}): tpuboot is not running or could not serve it"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(wait)
            try:
                sock.connect(f"/proc/self/fd/{fd}/{os.path.basename(RELAY_SOCKET)}")
            except OSError as exc:
                return f"{RELAY_SOCKET} does not answer ({exc.strerror or exc})"
            readable, _, _ = select.select([sock], [], [], wait)
            if readable:
                try:
                    closed = sock.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if closed:
                    return "the relay closed the connection: vBar refused it (is it running?)"
            return None
    finally:
        os.close(fd)


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _reads_spec_dir(dirs: list[object]) -> bool:
    """Whether a cdi-spec-dirs list has tpuboot's directory (/var/run is /run)."""
    wanted = {SPEC_DIR, SPEC_DIR.replace("/var/run", "/run", 1)}
    return any(str(d).rstrip("/") in wanted for d in dirs)
