"""The slice: `slice` and `wait-slice` (tpuboot/slice/, doc/slice.md)."""

from __future__ import annotations

import argparse
import sys

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json


def cmd_slice(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.slice.command import SliceLook, record, render

    looker = SliceLook(ctx.root, ctx.config, args.connect_timeout)
    try:
        report = looker(args.timeout)
    finally:
        looker.close()
    record(ctx.root, ctx.config.metrics, report)
    if args.json:
        print_json(report.as_dict())
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
