"""What each `tpuboot` command may import: its start-up cost, which `tpuboot bind` (the recovery
path) pays in full every time.

Each case runs the command in a fresh interpreter (``-I``: no PYTHONPATH, no user site) against an
empty root and compares the modules it loaded beyond the interpreter's own with its list. Listed
are tpuboot's modules, the third-party libraries, and the standard modules heavy enough to matter
(below); a new import on a command's path fails here until its list says so. Deferred imports
belong at command dispatch (the cmd_* functions of tpuboot/commands/), nowhere else; cli.py imports
only the chosen command's module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.helpers.cli import commands
from tpuboot import cli

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = {"yaml", "pyudev", "prometheus_client", "requests", "urllib3", "systemd", "grpc"}
#: Standard modules heavy enough to track (dataclasses brings inspect). Tracked only for commands
#: that load no library beyond yaml: requests and prometheus_client import some of them, differently
#: by version.
HEAVY_STDLIB = {"typing", "dataclasses", "inspect", "json", "subprocess", "asyncio", "concurrent",
                "socket", "ssl", "http", "email", "platform"}  # fmt: skip

CHILD = """
import sys
sys.path.insert(0, {repo!r})
before = set(sys.modules)
import tpuboot.cli
try:
    tpuboot.cli.main({argv!r})
except SystemExit:
    pass
print(" ".join(sorted(set(sys.modules) - before)))
"""

# What `import tpuboot.cli` and the device commands load: sysfs, the device table, the config
# (its sections are dataclasses; its metadata defaults are the client's, gce.settings).
CORE = {"tpuboot", "tpuboot.cli", "tpuboot.commands", "tpuboot.commands.context",
        "tpuboot.config", "tpuboot.configfields", "tpuboot.devices",
        "tpuboot.devices.pci", "tpuboot.devices.table", "tpuboot.devices.vfio", "tpuboot.errors",
        "tpuboot.kernel_params", "tpuboot.logs", "tpuboot.paths", "tpuboot.subproc", "tpuboot.gce",
        "tpuboot.gce.keys", "tpuboot.gce.settings", "tpuboot.endpoints", "tpuboot.numbers", "dataclasses",
        "inspect", "ipaddress", "typing"}  # fmt: skip
SURVEY = {"tpuboot.atomicfile", "tpuboot.devices.kmodule", "tpuboot.devices.survey", "dataclasses",
          "tpuboot.devices.health", "tpuboot.kernelfiles", "json",
          "inspect", "typing"}  # fmt: skip
# The metadata client, built from the config's section by tpuboot.wiring.metadata_settings.
METADATA = {"tpuboot.backoff", "tpuboot.gce.client", "tpuboot.gce.failures", "tpuboot.gce.framing",
            "tpuboot.eventloop", "tpuboot.gce.replies", "tpuboot.gce.settings", "tpuboot.gce.transport",
            "tpuboot.gce.watch",
            "tpuboot.netio", "tpuboot.numbers", "tpuboot.wiring", "requests", "urllib3"}  # fmt: skip
#: What reads tpu-env, its cache and /etc/environment (doctor); ENV also writes them (`tpuboot env`),
#: marking the boot budget (whose module has the daemon's READY mark, a Part: tpuboot.component).
ENV_READ = {"tpuboot.env", "tpuboot.env.assignment", "tpuboot.env.cache", "tpuboot.env.identity",
            "tpuboot.env.etc_environment", "tpuboot.env.tpuenv", "yaml", "json"}  # fmt: skip
ENV = ENV_READ | {"tpuboot.bootbudget", "tpuboot.component", "tpuboot.env.results", "tpuboot.env.sync",
                  "tpuboot.env.writers", "tpuboot.atomicfile", "tpuboot.kernelfiles"}  # fmt: skip
#: What records metrics, and their declarations: plain Python, no prometheus_client.
METRICS = {"tpuboot.metrics", "tpuboot.metrics_catalog"}
#: What shows them in Prometheus' format (a textfile, the daemon's endpoint): prometheus_client,
#: and the PCIe collector's sysfs readers; the endpoint's server backs off by tpuboot.backoff.
EXPORT = METRICS | {"tpuboot.metrics_export", "tpuboot.atomicfile", "tpuboot.metrics_server", "tpuboot.netio",
                    "prometheus_client", "tpuboot.devices.health", "tpuboot.devices.chips",
                    "tpuboot.backoff"}  # fmt: skip
#: The host's engine (tpuboot/containers/hostengine.py) and its client: Docker's.
ENGINE = {"tpuboot.containers", "tpuboot.containers.hostengine", "tpuboot.containers.engine",
          "tpuboot.containers.docker", "tpuboot.containers.dockerapi", "tpuboot.containers.dockerwire",
          "tpuboot.netio", "json", "socket", "ssl", "http", "email"}  # fmt: skip
#: The agents, as data.
AGENTS = {"tpuboot.containers.agents", "tpuboot.containers.liveness"}
# prepare-image's: its pull step over the engine, without the supervision.
CONTAINERS = ENGINE | AGENTS | {"tpuboot.references", "tpuboot.containers.credentials", "tpuboot.numbers"}
# doctor's container checks: the agents and the engine, not the supervision (nor its metrics).
DOCTOR_CONTAINERS = ENGINE | AGENTS | {"tpuboot.containers.gke", "tpuboot.checks.containers"}
#: What `who`, `release` and `wait-free` read of the devices: the survey, without PCIe health.
CHIPS = SURVEY - {"tpuboot.devices.health", "json"}
HOLDERS = {"tpuboot.devices.chips", "tpuboot.holders", "tpuboot.holders.locks", "tpuboot.holders.procfs",
           "tpuboot.holders.report", "tpuboot.holders.scan", "tpuboot.holders.bounded",
           "tpuboot.holders.targets", "tpuboot.kernelfiles", "tpuboot.numbers"}  # fmt: skip
#: Which holders are tpuboot's agents (`who` names them, `release --kill` spares them): the engine
#: is asked only about a process in one of its containers, but its client is loaded.
SUPERVISED = ENGINE | AGENTS | {"tpuboot.holders.supervised"}
RELEASE = SUPERVISED | {"tpuboot.holders.release"}
CHECKS = {"tpuboot.checks", "tpuboot.checks.image", "tpuboot.verdicts", "tpuboot.checks.kernel",
          "tpuboot.checks.limits", "tpuboot.checks.udev", "tpuboot.checks.leftovers",
          "tpuboot.checks.parsers", "tpuboot.checks.parsers.boot_runners", "tpuboot.checks.parsers.cmdline",
          "tpuboot.checks.parsers.files", "tpuboot.checks.parsers.grub", "tpuboot.checks.parsers.pam",
          "tpuboot.checks.parsers.rlimits", "tpuboot.checks.parsers.systemd", "tpuboot.checks.parsers.udev",
          "tpuboot.env", "tpuboot.env.assignment",
          "tpuboot.devices.kmodule", "tpuboot.atomicfile", "dataclasses", "inspect", "typing"}  # fmt: skip

CDI = {"tpuboot.containers", "tpuboot.containers.cdi", "tpuboot.devices.chips", "json"}

#: A config that sets something: PyYAML reads it.
PARSED = {"yaml"}
TEXTFILE_BIND = CORE | PARSED | EXPORT | SURVEY
DOCTOR = CORE | SURVEY | CHECKS | METADATA | ENV_READ | DOCTOR_CONTAINERS | HOLDERS | CDI | {
    "tpuboot.checks.doctor", "tpuboot.slice.shape", "tpuboot.checks.pcie", "tpuboot.checks.tpuenv",
    "tpuboot.checks.holders", "tpuboot.checks.cdi", "tpuboot.checks.notices", "tpuboot.notices",
    "tpuboot.checks.runtime", "tpuboot.runtime", "tpuboot.runtime.statefile", "tpuboot.runtime.client",
    "tpuboot.runtime.wire",
    "tpuboot.notices.noticefile", "tpuboot.records",
    # slice-identity: tpuboot slice's judgement of the identity, without the sweep
    "tpuboot.slice", "tpuboot.slice.facts", "tpuboot.slice.identity", "tpuboot.slice.resolve",
    "tpuboot.slice.workers"}  # fmt: skip

#: `slice` and `wait-slice`: the metadata client, tpu-env's parser, the slice reading, /proc's holders.
SLICE = CORE | METADATA | HOLDERS | SURVEY - {"tpuboot.devices.health", "json"} | {
    "tpuboot.verdicts", "tpuboot.slice.shape", "tpuboot.env",
    "tpuboot.env.assignment", "tpuboot.env.tpuenv", "tpuboot.holders.sockets", "tpuboot.numbers",
    "tpuboot.slice", "tpuboot.slice.command", "tpuboot.slice.facts", "tpuboot.slice.identity",
    "tpuboot.slice.ports", "tpuboot.slice.resolve", "tpuboot.slice.sweep", "tpuboot.slice.verdict",
    "tpuboot.slice.wait", "tpuboot.slice.workers", "yaml"}  # fmt: skip

#: `top`: the collector's code for one poll; grpcio itself only once a chip's holder listens.
RUNTIME = {"tpuboot.runtime", "tpuboot.runtime.top", "tpuboot.runtime.collector", "tpuboot.runtime.client",
           "tpuboot.runtime.wire", "tpuboot.runtime.reading", "tpuboot.runtime.ports",
           "tpuboot.runtime.statefile", "tpuboot.records", "tpuboot.holders.sockets", "tpuboot.atomicfile",
           "tpuboot.component",
           "tpuboot.env", "tpuboot.env.tpuenv", "tpuboot.env.assignment", "yaml", "json",
           "socket"}  # fmt: skip

#: What reads the daemon's notice file (`status`, doctor, `wait-maintenance`).
NOTICE_FILE = {
    "tpuboot.notices",
    "tpuboot.notices.noticefile",
    "tpuboot.records",
    "tpuboot.notices.wait",
    "tpuboot.atomicfile",
    "json",
}

#: Against another tree (as here) no metadata client: only the tpu-env cache's path is read.
PREPARE = CORE | CHECKS | METRICS | CONTAINERS | {"tpuboot.prepare", "tpuboot.env", "tpuboot.env.cache",
                                                   "tpuboot.env.identity"}  # fmt: skip

SETS_SOMETHING = "vfio: {node_mode: '0666'}\n"  # any key: the file is then read with PyYAML
TEXTFILE = "metrics: {textfile_dir: /metrics}\n"

#: name: (arguments after --root ROOT, config file text or None for none, what it may import).
CASES = {
    "--version": (["--version"], None, CORE),
    "bind": (["bind", "0000:00:04.0"], None, CORE),
    "bind, a config that sets something": (["bind", "0000:00:04.0"], SETS_SOMETHING, CORE | PARSED),
    "bind, metrics.textfile_dir set": (["bind", "0000:00:04.0"], TEXTFILE, TEXTFILE_BIND),
    "unbind": (["unbind", "0000:00:04.0"], None, CORE),
    "status": (["status"], None, CORE | SURVEY | NOTICE_FILE),
    "status --json": (["status", "--json"], None, CORE | SURVEY | {"json"}),
    "who": (["who"], None, CORE | CHIPS | HOLDERS | SUPERVISED),
    "who --json": (["who", "--json"], None, CORE | CHIPS | HOLDERS | SUPERVISED),
    "top": (["top"], None, CORE | CHIPS | HOLDERS | RUNTIME),
    "who, metrics.textfile_dir set": (
        ["who"],
        TEXTFILE,
        CORE | PARSED | SURVEY | HOLDERS | EXPORT | SUPERVISED,
    ),
    "release": (["release", "--dry-run"], None, CORE | CHIPS | HOLDERS | RELEASE),
    "wait-free": (
        ["wait-free", "--timeout", "0.1"],
        None,
        CORE | CHIPS | HOLDERS | {"tpuboot.holders.wait"},
    ),
    "reset": (
        ["reset", "--dry-run", "0000:00:04.0"],
        None,
        CORE | SURVEY | HOLDERS | RELEASE | {"tpuboot.devices.reset", "tpuboot.holders.freeing", "json"},
    ),
    "image-check": (["image-check"], None, CORE | CHECKS),
    "env": (["env", "--deadline", "0.2"], None, CORE | METADATA | ENV | METRICS),
    "metadata get": (
        ["metadata", "get", "x", "--deadline", "0.2"],
        None,
        CORE | METADATA | {"tpuboot.gce.lookup"},
    ),
    "doctor": (["doctor"], None, DOCTOR),
    # doctor's checks and the reset breaker's record, each rule's view of them (tpuboot/checks/npd.py).
    "npd": (["npd", "pcie"], None, DOCTOR | {"tpuboot.checks.npd", "tpuboot.devices.reset"}),
    "cdi": (["cdi"], None, CORE | CDI | {"tpuboot.atomicfile", "dataclasses", "inspect", "typing"}),
    "prepare-image": (["prepare-image"], None, PREPARE),
    "slice": (["slice", "--timeout", "0.2"], None, SLICE),
    "wait-slice": (["wait-slice", "--timeout", "0.2"], None, SLICE),
    "wait-maintenance": (["wait-maintenance", "--timeout", "0.1"], None, CORE | NOTICE_FILE),
}
#: The module of tpuboot/commands/ each case's command lives in (status shows the notices too).
MODULE = {
    "bind": "devices", "unbind": "devices", "status": "devices", "reset": "devices",
    "who": "holders", "release": "holders", "wait-free": "holders", "top": "runtime",
    "image-check": "checks", "prepare-image": "checks", "doctor": "checks", "npd": "checks",
    "env": "metadata", "metadata": "metadata", "cdi": "containers",
    "slice": "slice", "wait-slice": "slice", "wait-maintenance": "notices",
}  # fmt: skip
#: The daemon loads everything tpuboot has; tests/unit/test_run_start.py runs it whole.
NOT_HERE = {"run"}


def loaded(argv: list[str]) -> set[str]:
    """The modules `tpuboot ARGV` loads beyond what the interpreter itself has loaded."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GCE_METADATA_HOST": "127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-I", "-c", CHILD.format(repo=str(REPO), argv=argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return set(done.stdout.splitlines()[-1].split())


def tracked(modules: set[str], heavy: bool) -> set[str]:
    out = set()
    for name in modules:
        top = name.partition(".")[0]
        if top == "tpuboot":
            out.add(name)
        elif top in LIBRARIES or (heavy and top in HEAVY_STDLIB):
            out.add(top)
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_command_imports_only_what_its_list_says(case, tmp_path):
    args, config, allowed = CASES[case]
    if args[0] in MODULE:
        allowed = allowed | {f"tpuboot.commands.{MODULE[args[0]]}"}
    if args == ["status"]:
        allowed = allowed | {"tpuboot.commands.notices"}
    argv = ["--root", str(tmp_path), *args]
    if config is not None:
        (tmp_path / "tpuboot.yaml").write_text(config)
        argv[2:2] = ["--config", "/tpuboot.yaml"]
    heavy = not (allowed & (LIBRARIES - {"yaml"}))
    assert tracked(loaded(argv), heavy) == tracked(allowed, heavy)


def test_every_command_has_a_case():
    """A new command gets its list here (or a reason in NOT_HERE)."""
    covered = {" ".join(args[:2]) if args[0] == "metadata" else args[0] for args, _, _ in CASES.values()}
    every = {path for path, _ in commands(cli.build_parser())}
    assert every - NOT_HERE <= covered
