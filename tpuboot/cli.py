"""The `tpuboot` command line: the parser, and the dispatch to the chosen command's module
(tpuboot/commands/), imported only then. Exit status: 0 ok, 1 failed, 2 usage, 3 metadata key not set."""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys
from collections.abc import Callable, Sequence

from tpuboot import __version__, logs
from tpuboot.commands.context import EXIT_ABSENT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Context
from tpuboot.config import CONFIG_PATH
from tpuboot.errors import TpubootError, UsageError
from tpuboot.gce.keys import KINDS as METADATA_KINDS
from tpuboot.paths import ROOT_ENV

#: The exit statuses are the command line's: said here, defined beside the commands that return them.
__all__ = ["EXIT_ABSENT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]
Handler = Callable[[Context, argparse.Namespace], int]
log = logging.getLogger("tpuboot.cli")


def _seconds(text: str) -> float:
    """A --deadline: float() takes "nan" and "inf", which would never end or end at once."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and at most 3600")
    return value


def _slice_parsers(command: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    for name, module, what, timeout in (
        ("slice", "slice", "check this worker's slice: identity, paths to every peer, own ports", 20),
        (
            "wait-slice",
            "slice",
            "wait until this worker's identity holds and every peer's path is open",
            300,
        ),
    ):
        p = command(name, module, what)
        p.add_argument(
            "--timeout",
            type=_seconds,
            default=float(timeout),
            metavar="S",
            help=f"within S seconds (default {timeout})",
        )
        p.add_argument(
            "--connect-timeout",
            type=_seconds,
            default=2.0,
            metavar="S",
            help="one connect within S seconds (default 2)",
        )
        if name == "slice":
            p.add_argument("--json", action="store_true", help="machine-readable output")
        else:
            p.add_argument(
                "--interval", type=_seconds, default=1.0, metavar="S", help="look every S seconds (default 1)"
            )


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(
        prog="tpuboot",
        description="Boot-time agent for Cloud TPU VMs.",
        epilog="Exit status: 0 ok, 1 failed, 2 usage error, 3 metadata key not set, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"tpuboot {__version__}")
    parser.add_argument(
        "--root", metavar="DIR", help=f"act on the tree under DIR instead of / (also ${ROOT_ENV})"
    )
    parser.add_argument("--config", metavar="FILE", help=f"configuration file (default {CONFIG_PATH})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, module: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(handler=(module, "cmd_" + name.replace("-", "_")))
        return p

    command("run", "daemon", "run the boot-time service (systemd Type=notify)")
    for name, module, what in (
        ("bind", "devices", "bind TPUs to vfio-pci by hand (recovery)"),
        ("unbind", "devices", "give TPUs back to the kernel's default driver"),
    ):
        p = command(name, module, what)
        p.add_argument("dbdf", nargs="+", metavar="DBDF", help="PCI address, dddd:bb:dd.f or bb:dd.f")
        p.add_argument("--force", action="store_true", help="also act on a device that is not a TPU")
    p = command("status", "devices", "show every TPU: generation, driver, IOMMU group, node, PCIe health")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--boot", action="store_true", help="where this boot's time went, phase by phase")
    p = command(
        "who", "holders", "show who holds each TPU chip and libtpu's lock files (exit 1: something is held)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command(
        "top", "runtime", "show each chip holder's duty cycle, HBM and faults as its libtpu reports them"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("release", "holders", "remove libtpu lock files nobody holds; report (and end) holders")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    p.add_argument("--kill", action="store_true", help="also end the holders: SIGTERM, then SIGKILL")
    p = command("reset", "devices", "bring a wedged TPU chip back: function reset, rebind, remove and rescan")
    p.add_argument("dbdf", metavar="DBDF", help="PCI address of the chip (any of its functions)")
    p.add_argument("--dry-run", action="store_true", help="say what each rung would do, do nothing")
    p.add_argument("--kill", action="store_true", help="end the chip's holders first: SIGTERM, then SIGKILL")
    p = command("wait-free", "holders", "wait until every TPU chip and libtpu lock is free")
    p.add_argument(
        "--timeout", type=_seconds, default=60.0, metavar="S", help="give up after S seconds (default 60)"
    )
    _slice_parsers(command)
    p = command(
        "wait-maintenance",
        "notices",
        "wait until the host is warned of maintenance or preemption (exit 0), from /run/tpuboot/notice",
    )
    p.add_argument(
        "--timeout", type=_seconds, metavar="S", help="give up after S seconds (exit 1; default: wait)"
    )
    p.add_argument("--kind", action="append", choices=("maintenance", "upcoming", "preempted"),
                   help="only this kind of notice (repeatable; default: any)")  # fmt: skip
    p.add_argument(
        "--check", action="store_true", help="do not wait: exit 0 if a notice is active now, else 1"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("image-check", "checks", "report which TPU image settings are in force, with fixes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="run only these checks (shell patterns, e.g. 'leftover-*'; repeatable)",
    )
    p = command(
        "prepare-image",
        "checks",
        "last step of an image build: check the next boot, pull the images, remove instance state",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("doctor", "checks", "check that this TPU VM is ready for a workload, with fixes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    # No handler: main answers npd before any context is made (a failure there is npd's one line).
    what = "answer one node-problem-detector rule: one line, exit 0 ok, 1 problem, 2 unknown"
    p = sub.add_parser("npd", help=what, description=what)
    p.add_argument("condition", metavar="CONDITION", help="the rule: a condition doc/kubernetes.md lists")
    p = command(
        "cdi", "containers", "print the CDI spec of the bound chips (containers without --privileged)"
    )
    p.epilog = (
        "A job's container gets the chips, tpu-env's topology, vBar and /tmp/tpu_logs from the spec, "
        "with no --privileged and no --net=host: podman run --device google.com/tpu=all IMAGE, or "
        "docker run --device google.com/tpu=all --ulimit memlock=-1:-1 IMAGE (a spec cannot raise "
        "the memlock limit libtpu needs: docker's line raises it, podman passes on its caller's)."
    )
    p.add_argument("--format", choices=("json", "yaml"), default="json", help="output format (default json)")
    p.add_argument("--output", metavar="FILE", help="write the spec to FILE (atomically), not to stdout")
    p = command("env", "metadata", "fetch tpu-env once and write it and /etc/environment")
    p.add_argument("--print", action="store_true", help="also print the tpu-env file written")
    p.add_argument("--deadline", type=_seconds, metavar="S", help="give up on the server after S seconds")
    meta = sub.add_parser(
        "metadata", help="read the GCE metadata server", description="read the GCE metadata server"
    )
    meta_sub = meta.add_subparsers(dest="metadata_command", required=True, metavar="ACTION")
    p = meta_sub.add_parser(
        "get", help="print one metadata value (raw text)", description="print one metadata value"
    )
    p.set_defaults(handler=("metadata", "cmd_metadata_get"))
    p.add_argument("key", metavar="KEY", help="attribute name (or path, with --type instance)")
    p.add_argument("--default", metavar="VALUE", help="print VALUE when the key is not set (exit 0)")
    p.add_argument("--type", choices=tuple(METADATA_KINDS), default="attributes", help="where KEY lives")
    p.add_argument("--deadline", type=_seconds, default=15.0, metavar="S", help="retry for at most S seconds")
    return parser


def handler(args: argparse.Namespace) -> Handler:
    """The chosen command's function, its module imported now (tpuboot/commands/<module>.py)."""
    module, name = args.handler
    found: Handler = getattr(importlib.import_module(f"tpuboot.commands.{module}"), name)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(args.verbose)
    if args.command == "npd":  # its own protocol: every failure is its one line and exit 2
        from tpuboot.commands.checks import npd_main

        return npd_main(args)
    ctx: Context | None = None
    try:
        ctx = Context(args)
        status: int = handler(args)(ctx, args)
        return status
    except UsageError as exc:
        print(f"tpuboot: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TpubootError as exc:
        print(f"tpuboot: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if ctx is not None and args.command in TEXTFILE_COMMANDS:
            _write_metrics_textfile(ctx)


TEXTFILE_COMMANDS = ("bind", "unbind", "env", "who")


def _write_metrics_textfile(ctx: Context) -> None:
    """After a one-shot command: its metrics to ``metrics.textfile_dir`` for node_exporter, if set."""
    try:
        config = ctx.config
    except TpubootError:
        return  # the command has said why (its one line); no second line for the same error
    try:
        if config.metrics.textfile_dir is None:
            return
        from tpuboot import metrics, metrics_export
        from tpuboot.devices.survey import survey

        tpus = survey(ctx.binder())
    except Exception as exc:  # the metrics file never changes a command's outcome
        log.warning("metrics: %s", exc)
        return
    metrics.tpus((t.kind, "bound" if t.driver == "vfio-pci" else "unbound") for t in tpus if t.managed)
    metrics_export.write_textfile(ctx.root, config.metrics)
