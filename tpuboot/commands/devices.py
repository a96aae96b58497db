"""The device commands: `bind` and `unbind` (recovery by hand), `status` and `reset`.

`bind` is the recovery path and pays its imports in full every time: what only `status` or
`reset` needs is imported inside them."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json
from tpuboot.devices.pci import parse_dbdf
from tpuboot.devices.table import DeviceTable
from tpuboot.errors import TpubootError, UsageError

if TYPE_CHECKING:
    from tpuboot.devices.chips import Chip
    from tpuboot.devices.reset import Breaker
    from tpuboot.holders.report import Report

log = logging.getLogger("tpuboot.cli")


def _addresses(texts: Sequence[str]) -> list[str]:
    """Validate every address before touching any device."""
    return [parse_dbdf(text) for text in texts]


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
        print_json([{**t.as_dict(), "pcie": health[t.address].as_dict(), **held[t.address]} for t in tpus])
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
        from tpuboot.commands.notices import print_notice

        print_notice(ctx)
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
        print_json(budget)
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
