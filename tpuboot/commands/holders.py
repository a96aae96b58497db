"""Who holds the chips: `who`, `release` and `wait-free` (tpuboot/holders/, doc/holders.md)."""

from __future__ import annotations

import argparse
import sys

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json
from tpuboot.errors import UsageError


def held_exit(report: object) -> int:
    return EXIT_OK if getattr(report, "free", False) else EXIT_FAILED


def cmd_who(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.holders.report import chips_of, gather, render
    from tpuboot.holders.supervised import supervised

    report = gather(ctx.root, chips_of(ctx.root, ctx.config))
    agent = supervised(ctx.root, ctx.config).reason
    if ctx.config.metrics.textfile_dir is not None:
        from tpuboot import metrics

        metrics.holders(report.holder_counts(), report.lock_states())
    if args.json:
        print_json(report.as_dict(agent))
    else:
        print("\n".join(render(report, agent)))
    return held_exit(report)


def cmd_release(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.holders.release import release
    from tpuboot.holders.report import chips_of, gather
    from tpuboot.holders.supervised import supervised

    if args.kill and not args.dry_run and not ctx.root.is_host:
        raise UsageError("--kill ends processes of this host only; it cannot act on a --root tree")
    report = gather(ctx.root, chips_of(ctx.root, ctx.config))
    agents = supervised(ctx.root, ctx.config)
    for line in release(ctx.root, report, agents, dry_run=args.dry_run, kill=args.kill):
        print(line)
    if args.dry_run:
        return held_exit(report)
    return held_exit(gather(ctx.root, chips_of(ctx.root, ctx.config)))


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
