"""The `tpuboot` command line. Exit status: 0 ok, 1 failed, 2 usage, 3 metadata key not set."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tpuboot import __version__, logs
from tpuboot.config import CONFIG_PATH, Config, load_config
from tpuboot.devices.pci import parse_dbdf
from tpuboot.devices.table import DeviceTable
from tpuboot.devices.vfio import Binder
from tpuboot.errors import ConfigError, TpubootError, UsageError
from tpuboot.gce.keys import KINDS as METADATA_KINDS
from tpuboot.paths import ROOT_ENV, Root

if TYPE_CHECKING:
    from tpuboot.devices.chips import Chip
    from tpuboot.devices.reset import Breaker
    from tpuboot.holders.report import Report
    from tpuboot.verdicts import CheckResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_ABSENT = 3  # `metadata get`: the key is not set and no --default was given
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), 128 + 2 as a shell reports a command it killed
Handler = Callable[["Context", argparse.Namespace], int]
log = logging.getLogger("tpuboot.cli")


class Context:
    """What every command needs, built from the global options."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.root = Root.from_env(args.root)
        self.config_path: str | None = args.config
        self._config: Config | None = None

    @property
    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(self.root, self.config_path)
        return self._config

    def binder(self) -> Binder:
        return Binder.of(self.root, self.config)


def _addresses(texts: Sequence[str]) -> list[str]:
    """Validate every address before touching any device."""
    return [parse_dbdf(text) for text in texts]


# Commands import what only they need, so `tpuboot bind` starts without requests and friends.


def cmd_run(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.signals import hold_until_served

    hold_until_served()  # until the loop gives each signal its meaning (tpuboot/signals.py)
    try:
        config = ctx.config
    except ConfigError as exc:  # a daemon that exits on a typo leaves the TPUs unbound
        log.error("%s; running with built-in defaults", exc)
        config = Config()
    from tpuboot.wiring import build  # binds the TPUs present while the rest loads

    return build(ctx.root, config).serve()


def _print_json(data: Mapping[str, object] | Sequence[Mapping[str, object]]) -> None:
    """A --json answer: one object for one report, a list for records of one kind (doc/operation.md)."""
    import json

    print(json.dumps(data, indent=2))


def _seconds(text: str) -> float:
    """A --deadline: float() takes "nan" and "inf", which would never end or end at once."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and at most 3600")
    return value


def _for_each(texts: Sequence[str], act: Callable[[str], str]) -> int:
    """Run ``act`` on every address (all validated first); one failure does not stop the rest."""
    failed = 0
    for address in _addresses(texts):
        try:
            print(act(address))
        except TpubootError as exc:
            print(f"tpuboot: {exc}", file=sys.stderr)
            failed += 1
        except Exception as exc:  # a bug: one line here, the traceback with --verbose, the rest go on
            log.debug("%s: unexpected error", address, exc_info=True)
            print(
                f"tpuboot: {address}: unexpected {type(exc).__name__} ({exc}); please report it",
                file=sys.stderr,
            )
            failed += 1
    return EXIT_FAILED if failed else EXIT_OK


def cmd_bind(ctx: Context, args: argparse.Namespace) -> int:
    binder = ctx.binder()
    do_bind = binder.bind
    if ctx.config.metrics.textfile_dir is not None:
        from tpuboot import metrics

        do_bind = functools.partial(metrics.timed_bind, binder.bind)

    def bind(address: str) -> str:
        result = do_bind(address, force=args.force)
        state = "bound to vfio-pci" if result.changed else "already bound to vfio-pci"
        return f"{address} ({result.kind}) {state}, {result.node} mode {binder.config.node_mode:04o}"

    return _for_each(args.dbdf, bind)


def cmd_unbind(ctx: Context, args: argparse.Namespace) -> int:
    binder = ctx.binder()

    def unbind(address: str) -> str:
        driver = binder.unbind(address, force=args.force)
        return f"{address} released from vfio-pci, now driven by {driver or 'no driver'}"

    return _for_each(args.dbdf, unbind)


def cmd_status(ctx: Context, args: argparse.Namespace) -> int:
    if args.boot:
        return _print_boot(ctx, args.json)
    from tpuboot.devices.health import judge, read_healths
    from tpuboot.devices.survey import driver_summary, survey

    binder = ctx.binder()
    tpus = survey(binder)
    health = read_healths(ctx.root, (t.address for t in tpus))
    if args.json:
        held = _chip_holders(ctx, tpus)
        _print_json([{**t.as_dict(), "pcie": health[t.address].as_dict(), **held[t.address]} for t in tpus])
    elif not tpus:
        print("no TPUs found")
    else:
        # First, since lsmod cannot tell on Ubuntu (vfio-pci built in) and an operator would ask.
        print(driver_summary(binder))
        for t in tpus:
            node = f"{t.node} {t.node_mode}" if t.node else "no node"
            group = f"group {t.iommu_group}" if t.iommu_group else "no IOMMU group"
            link = health[t.address].link
            pcie = f"  {link}" if link is not None else ""
            problems = [t.problem] if t.problem else []
            problems += [f.detail for f in judge(health[t.address])]
            line = f"{t.address}  {t.kind:<12} {t.driver or 'no driver':<12} {group:<10} {node}{pcie}"
            print(line + "".join(f"  ! {p}" for p in problems))
        _print_chip_holders(ctx, tpus)
    if not args.json:
        _print_notice(ctx)
    failing = any(f.level == "FAIL" for t in tpus if t.managed for f in judge(health[t.address]))
    return EXIT_FAILED if failing or any(t.problem and t.managed for t in tpus) else EXIT_OK


def _print_boot(ctx: Context, as_json: bool) -> int:
    """`status --boot`: the phases of this boot as the daemon recorded them at READY."""
    from tpuboot import bootbudget

    budget = bootbudget.load(ctx.root)
    if budget is None:
        print(
            f"tpuboot: no boot budget in {bootbudget.BUDGET_PATH}: tpuboot run has not said READY "
            "since this boot; systemctl status tpuboot says why",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if as_json:
        _print_json(budget)
        return EXIT_OK
    after = budget.get("started_after_boot_seconds")
    if isinstance(after, (int, float)):
        print(f"tpuboot started {after:.2f} s after the kernel; each phase ended at, since then:")
    phases = budget.get("phases")
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict):
            detail = f" {phase.get('detail')}" if phase.get("detail") else ""
            print(f"{phase.get('seconds', 0.0):>9.3f} s  {phase.get('phase')}{detail}")
    return EXIT_OK


def _gather_chips(ctx: Context, tpus: Sequence[object]) -> Report | None:
    """Who holds the survey's chips (`tpuboot who`'s /proc scan); None without a TPU."""
    if not tpus:
        return None
    from tpuboot.devices.chips import chips_present
    from tpuboot.holders.report import gather

    chips = chips_present(ctx.root, DeviceTable(ctx.config.devices), tpus)  # type: ignore[arg-type]
    return gather(ctx.root, chips)


def _print_chip_holders(ctx: Context, tpus: Sequence[object]) -> None:
    """Each chip and who holds it, after the functions (`tpuboot who` has the detail)."""
    from tpuboot.holders.report import summary

    report = _gather_chips(ctx, tpus)
    for c in report.chips if report else []:
        print(f"chip {c.chip.index}  {c.chip.address}  {c.chip.kind:<12} {summary(c, report)}")


def _chip_holders(ctx: Context, tpus: Sequence[object]) -> dict[str, dict[str, object]]:
    """For `status --json`, by function: its chip's index and that chip's holders (as `who --json`
    gives them), and whether the chip may be held by what the scan could not tie or see."""
    report = _gather_chips(ctx, tpus)
    if report is None:
        return {}
    maybe = report.maybe_held
    return {
        fn.address: {
            "chip": c.chip.index,
            "holders": [h.as_dict() for h in c.holders],
            "maybe_held": maybe,
        }
        for c in report.chips
        for fn in c.chip.functions
    }


def _held_exit(report: object) -> int:
    return EXIT_OK if getattr(report, "free", False) else EXIT_FAILED


def cmd_who(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.holders.report import chips_of, gather, render

    report = gather(ctx.root, chips_of(ctx.root, ctx.config))
    if ctx.config.metrics.textfile_dir is not None:
        from tpuboot import metrics

        metrics.holders(report.holder_counts(), report.lock_states())
    if args.json:
        _print_json(report.as_dict())
    else:
        print("\n".join(render(report)))
    return _held_exit(report)


def cmd_top(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.runtime.top import as_dict, healthy, look, render

    snapshot = look(ctx.root, ctx.config)
    if args.json:
        _print_json(as_dict(snapshot))
    else:
        print("\n".join(render(snapshot)))
    return EXIT_OK if healthy(snapshot) else EXIT_FAILED


def cmd_release(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.holders.release import VbarProcesses, release, vbar_processes
    from tpuboot.holders.report import chips_of, gather

    if args.kill and not args.dry_run and not ctx.root.is_host:
        raise UsageError("--kill ends processes of this host only; it cannot act on a --root tree")
    report = gather(ctx.root, chips_of(ctx.root, ctx.config))
    vbar = vbar_processes(ctx.root, ctx.config) if args.kill else VbarProcesses()
    for line in release(ctx.root, report, vbar, dry_run=args.dry_run, kill=args.kill):
        print(line)
    if args.dry_run:
        return _held_exit(report)
    return _held_exit(gather(ctx.root, chips_of(ctx.root, ctx.config)))


def cmd_wait_free(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.holders.report import chips_of, gather, render
    from tpuboot.holders.wait import wait_free

    report = wait_free(lambda: gather(ctx.root, chips_of(ctx.root, ctx.config)), args.timeout)
    if report.free:
        print("every chip and lock is free")
        return EXIT_OK
    print(f"still held, or not every process seen, after {args.timeout:g} s:", file=sys.stderr)
    print("\n".join(render(report)), file=sys.stderr)
    return EXIT_FAILED


# --- maintenance and preemption notices: `tpuboot wait-maintenance` (tpuboot/notices/, doc/notices.md) ---


def cmd_wait_maintenance(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.notices import noticefile
    from tpuboot.notices.wait import current, wait

    kinds = args.kind or None
    active = current(ctx.root, kinds) if args.check else wait(ctx.root, args.timeout, kinds)
    if args.json:
        _print_json(active or [])
    else:
        print("\n".join(noticefile.describe(n) for n in active or []), end="\n" if active else "")
    if active:
        return EXIT_OK
    if active is None:  # --check, and no file: nothing watches, or the daemon has not heard yet
        print(
            f"tpuboot: no {noticefile.NOTICE_PATH}: is tpuboot running with notices.enabled?", file=sys.stderr
        )
    elif not args.check:
        print(f"tpuboot: no notice in {args.timeout:g} s", file=sys.stderr)
    return EXIT_FAILED


def _print_notice(ctx: Context) -> None:
    """`status`: the active notices, if the daemon wrote any (a line each)."""
    from tpuboot.notices import noticefile
    from tpuboot.notices.wait import current

    for notice in current(ctx.root) or []:
        print(f"notice: {noticefile.describe(notice)}")


# --- the slice: `tpuboot slice` and `tpuboot wait-slice` (tpuboot/slice/, doc/slice.md) ---


def cmd_slice(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.slice.command import SliceLook, record, render

    looker = SliceLook(ctx.root, ctx.config, args.connect_timeout)
    try:
        report = looker(args.timeout)
    finally:
        looker.close()
    record(ctx.root, ctx.config.metrics, report)
    if args.json:
        _print_json(report.as_dict())
    else:
        print("\n".join(render(report)))
    return EXIT_OK if report.holds else EXIT_FAILED


def cmd_wait_slice(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.slice.command import Remembered, SliceLook, record, wait

    looker = SliceLook(ctx.root, ctx.config, args.connect_timeout)
    remembered = Remembered(looker)
    try:
        wrong = wait(
            remembered, args.timeout, args.interval, lambda line: print(line, file=sys.stderr, flush=True)
        )
    finally:
        looker.close()
    record(ctx.root, ctx.config.metrics, remembered.last)
    if not wrong:
        print("the slice holds: identity agrees and every peer's path is open")
        return EXIT_OK
    print(f"tpuboot: the slice still does not hold after {args.timeout:g} s:", file=sys.stderr)
    print("\n".join(wrong), file=sys.stderr)
    return EXIT_FAILED


def _slice_parsers(command: Callable[[str, Handler, str], argparse.ArgumentParser]) -> None:
    for name, func, what, timeout in (
        ("slice", cmd_slice, "check this worker's slice: identity, paths to every peer, own ports", 20),
        (
            "wait-slice",
            cmd_wait_slice,
            "wait until this worker's identity holds and every peer's path is open",
            300,
        ),
    ):
        p = command(name, func, what)
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


def cmd_reset(ctx: Context, args: argparse.Namespace) -> int:
    import os

    from tpuboot.devices.reset import Breaker, Ladder, chip_to_reset, need_root
    from tpuboot.holders import freeing
    from tpuboot.holders.report import chips_of

    if not args.dry_run and not ctx.root.is_host:
        raise UsageError(
            "reset acts on this host's kernel only; it cannot act on a --root tree (try --dry-run)"
        )
    address = parse_dbdf(args.dbdf)
    if not args.dry_run:
        need_root(os.geteuid())
    breaker = Breaker(ctx.root, ctx.config.recovery.max_resets_per_hour)
    chip = chip_to_reset(ctx.root, chips_of(ctx.root, ctx.config), address, breaker)
    ladder = Ladder(ctx.binder(), breaker)
    if args.dry_run:
        print("\n".join(ladder.plan(chip)))
        refused = _reset_refusals(ctx, chip, breaker, kill=args.kill)
        for why in refused:
            print(f"tpuboot: the reset would be refused: {why}", file=sys.stderr)
        return EXIT_FAILED if refused else EXIT_OK
    breaker.check(chip.address)  # before --kill ends anybody: the climb checks again, under its lock
    for line in freeing.free(ctx.root, ctx.config, chip, kill=args.kill):
        print(line)
    steps = ladder.climb(chip)
    for step in steps:
        outcome = "brought it back" if step.back else f"not back: {step.problem}"
        print(f"{step.rung}: {step.done}; {outcome}")
    if steps and steps[-1].back:
        return EXIT_OK
    print(
        f"tpuboot: chip {chip.address} did not come back from any reset; stop and start the VM",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _reset_refusals(ctx: Context, chip: Chip, breaker: Breaker, *, kill: bool) -> list[str]:
    """What a real `tpuboot reset` of ``chip`` would refuse now, each in one line, for --dry-run:
    not root (on the host), its breaker open, its holders (tpuboot/holders/freeing.py)."""
    import os

    from tpuboot.devices.reset import ResetRefused, need_root
    from tpuboot.holders import freeing
    from tpuboot.holders.report import describe

    refused = []
    checks = [functools.partial(breaker.check, chip.address)]
    if ctx.root.is_host:  # under --root, the tree's record and holders; whoever runs it
        checks.insert(0, functools.partial(need_root, os.geteuid()))
    for check in checks:
        try:
            check()
        except ResetRefused as exc:
            refused.append(str(exc))
    judged = freeing.judge(ctx.root, ctx.config, chip, kill=kill)
    for p in judged.to_end:
        print(f"--kill: would end {describe(p)} first")
    return [*refused, *judged.refusals]


def cmd_metadata_get(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.gce.client import MetadataClient
    from tpuboot.gce.lookup import metadata_get
    from tpuboot.gce.replies import MetadataAbsent
    from tpuboot.wiring import metadata_settings

    client = MetadataClient.from_settings(metadata_settings(ctx.config.metadata), log_retries=False)
    try:
        value = metadata_get(client, args.type, args.key, deadline_s=args.deadline)
    except MetadataAbsent:
        if args.default is None:
            print(
                f"tpuboot: metadata {args.type} {args.key!r} is not set; pass --default to accept that",
                file=sys.stderr,
            )
            return EXIT_ABSENT
        value = args.default
    sys.stdout.write(value if not sys.stdout.isatty() or value.endswith("\n") else value + "\n")
    return EXIT_OK


def cmd_env(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot import metrics  # its requests go to metrics.textfile_dir, like bind's
    from tpuboot.env.sync import EnvSync
    from tpuboot.gce.client import MetadataClient
    from tpuboot.wiring import metadata_settings

    config = ctx.config
    settings = metadata_settings(config.metadata)
    client = MetadataClient.from_settings(settings, on_request=metrics.metadata_request, log_retries=False)
    # Its result is said once, as the service says it (a line on stderr): --print's stdout is tpu-env alone.
    result = EnvSync(ctx.root, config, client).sync_once(args.deadline or config.metadata.boot_deadline)
    if args.print and result.source in ("metadata", "cache"):
        sys.stdout.write(ctx.root.path(config.env.tpu_env_path).read_text(encoding="utf-8"))
    return EXIT_OK if result.source in ("metadata", "absent") else EXIT_FAILED


def cmd_image_check(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.checks.image import run_checks

    return _report(run_checks(ctx.root, [p for text in args.only for p in text.split(",") if p]), args.json)


def cmd_doctor(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.checks.doctor import Doctor, failed_required, metadata_lookup

    config = ctx.config
    lookup = metadata_lookup(config.metadata) if ctx.root.is_host else None
    verdicts = Doctor(ctx.root, config, metadata=lookup).run()
    if args.json:
        _print_json([v.as_dict() for v in verdicts])
    else:
        for v in verdicts:
            r = v.result
            fix = f"  fix: {r.fix}" if r.status in ("FAIL", "WARN") and r.fix else ""
            note = "" if v.required or r.status != "FAIL" else " (advisory)"
            print(f"{r.status:<4}  {r.name}{note}: {r.detail}{fix}")
    return EXIT_FAILED if failed_required(verdicts) else EXIT_OK


def npd_main(args: argparse.Namespace) -> int:
    """`tpuboot npd CONDITION` speaks node-problem-detector's plugin protocol, not the CLI's: one
    line on stdout (the condition's message), exit 0 OK, 1 problem, 2 unknown. Whatever stops the
    answer (a root or a configuration it cannot read, a check that raises) is unknown, in one line:
    NPD would put a traceback in the node's condition."""
    from tpuboot.checks import npd

    condition = npd.BY_NAME.get(args.condition)
    try:
        if condition is None:
            raise UsageError(f"no condition {args.condition!r}: {', '.join(npd.BY_NAME)}")
        ctx = Context(args)
        answer = npd.judge(ctx.root, ctx.config, condition)
    except Exception as exc:  # unknown, said in one line; the traceback with --verbose, on stderr
        log.debug("npd %s: cannot answer", args.condition, exc_info=True)
        what = str(exc) if isinstance(exc, TpubootError) else f"unexpected {type(exc).__name__}: {exc}"
        answer = npd.Answer(npd.UNKNOWN, what)
    if condition is not None:
        answer = npd.for_rule(condition, answer)
    print(answer.line, flush=True)
    return answer.status


def cmd_cdi(ctx: Context, args: argparse.Namespace) -> int:
    """The CDI spec the daemon keeps, read from sysfs now: printed, or written to --output (under
    --root, a file in the tree, as every path tpuboot touches there)."""
    import os

    from tpuboot.atomicfile import write_file
    from tpuboot.containers.cdi import current_chips, render, to_json, to_yaml

    spec = render(current_chips(ctx.binder()))
    if spec is None:
        raise TpubootError(
            "no TPU chip is bound to vfio-pci or served by the accel driver: no CDI device to describe; "
            "tpuboot status says why (tpuboot bind DBDF binds one)"
        )
    data = to_yaml(spec) if args.format == "yaml" else to_json(spec)
    if args.output is None:
        sys.stdout.write(data.decode())
    elif ctx.root.is_host:
        write_file(ctx.root, os.path.abspath(args.output), data, mode=0o644)
    elif args.output.startswith("/"):  # inside the root, links resolved there, as every path is
        write_file(ctx.root, args.output, data, mode=0o644)
    else:
        raise UsageError(
            f"--output {args.output} under --root: give the file's absolute path in the tree "
            f"(--output /etc/cdi/google.com-tpu.json writes {ctx.root.prefix}/etc/cdi/google.com-tpu.json)"
        )
    return EXIT_OK


def cmd_prepare_image(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.prepare import prepare

    return _report(prepare(ctx.root, ctx.config), args.json)


def _report(results: Sequence[CheckResult], as_json: bool) -> int:
    """image-check's and prepare-image's output: one line per result, the fix after a FAIL or WARN."""
    if as_json:
        _print_json([r.as_dict() for r in results])
    else:
        for r in results:
            fix = f"  fix: {r.fix}" if r.status in ("FAIL", "WARN") and r.fix else ""
            print(f"{r.status:<4}  {r.name}: {r.detail}{fix}")
    return EXIT_FAILED if any(r.status == "FAIL" for r in results) else EXIT_OK


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

    def command(name: str, func: Handler, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    command("run", cmd_run, "run the boot-time service (systemd Type=notify)")
    for name, func, what in (
        ("bind", cmd_bind, "bind TPUs to vfio-pci by hand (recovery)"),
        ("unbind", cmd_unbind, "give TPUs back to the kernel's default driver"),
    ):
        p = command(name, func, what)
        p.add_argument("dbdf", nargs="+", metavar="DBDF", help="PCI address, dddd:bb:dd.f or bb:dd.f")
        p.add_argument("--force", action="store_true", help="also act on a device that is not a TPU")
    p = command("status", cmd_status, "show every TPU: generation, driver, IOMMU group, node, PCIe health")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--boot", action="store_true", help="where this boot's time went, phase by phase")
    p = command(
        "who", cmd_who, "show who holds each TPU chip and libtpu's lock files (exit 1: something is held)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command(
        "top", cmd_top, "show each chip holder's duty cycle, HBM and faults as its libtpu reports them"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("release", cmd_release, "remove libtpu lock files nobody holds; report (and end) holders")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    p.add_argument("--kill", action="store_true", help="also end the holders: SIGTERM, then SIGKILL")
    p = command("reset", cmd_reset, "bring a wedged TPU chip back: function reset, rebind, remove and rescan")
    p.add_argument("dbdf", metavar="DBDF", help="PCI address of the chip (any of its functions)")
    p.add_argument("--dry-run", action="store_true", help="say what each rung would do, do nothing")
    p.add_argument("--kill", action="store_true", help="end the chip's holders first: SIGTERM, then SIGKILL")
    p = command("wait-free", cmd_wait_free, "wait until every TPU chip and libtpu lock is free")
    p.add_argument(
        "--timeout", type=_seconds, default=60.0, metavar="S", help="give up after S seconds (default 60)"
    )
    _slice_parsers(command)
    p = command(
        "wait-maintenance",
        cmd_wait_maintenance,
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
    p = command("image-check", cmd_image_check, "report which TPU image settings are in force, with fixes")
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
        cmd_prepare_image,
        "last step of an image build: check the next boot, pull the images, remove instance state",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command("doctor", cmd_doctor, "check that this TPU VM is ready for a workload, with fixes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = command(
        "npd", cmd_npd, "answer one node-problem-detector rule: one line, exit 0 ok, 1 problem, 2 unknown"
    )
    p.add_argument("condition", metavar="CONDITION", help="the rule: a condition doc/kubernetes.md lists")
    p = command("cdi", cmd_cdi, "print the CDI spec of the bound chips (containers without --privileged)")
    p.add_argument("--format", choices=("json", "yaml"), default="json", help="output format (default json)")
    p.add_argument("--output", metavar="FILE", help="write the spec to FILE (atomically), not to stdout")
    p = command("env", cmd_env, "fetch tpu-env once and write it and /etc/environment")
    p.add_argument("--print", action="store_true", help="also print the tpu-env file written")
    p.add_argument("--deadline", type=_seconds, metavar="S", help="give up on the server after S seconds")
    meta = sub.add_parser(
        "metadata", help="read the GCE metadata server", description="read the GCE metadata server"
    )
    meta_sub = meta.add_subparsers(dest="metadata_command", required=True, metavar="ACTION")
    p = meta_sub.add_parser(
        "get", help="print one metadata value (raw text)", description="print one metadata value"
    )
    p.set_defaults(func=cmd_metadata_get)
    p.add_argument("key", metavar="KEY", help="attribute name (or path, with --type instance)")
    p.add_argument("--default", metavar="VALUE", help="print VALUE when the key is not set (exit 0)")
    p.add_argument("--type", choices=tuple(METADATA_KINDS), default="attributes", help="where KEY lives")
    p.add_argument("--deadline", type=_seconds, default=15.0, metavar="S", help="retry for at most S seconds")
    return parser


def cmd_npd(ctx: Context, args: argparse.Namespace) -> int:
    """Never called with a context: :func:`main` hands `npd` to :func:`npd_main` before one is made."""
    return npd_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logs.setup(args.verbose)
    if args.command == "npd":  # its own protocol: every failure is its one line and exit 2
        return npd_main(args)
    ctx: Context | None = None
    try:
        ctx = Context(args)
        status: int = args.func(ctx, args)
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
