"""Maintenance and preemption notices: `wait-maintenance`, and the lines `status` shows
(tpuboot/notices/, doc/notices.md)."""

from __future__ import annotations

import argparse
import sys

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json


def cmd_wait_maintenance(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.notices import noticefile
    from tpuboot.notices.wait import current, wait

    kinds = args.kind or None
    active = current(ctx.root, kinds) if args.check else wait(ctx.root, args.timeout, kinds)
    if args.json:
        print_json(active or [])
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


def print_notice(ctx: Context) -> None:
    """`status`: the active notices, if the daemon wrote any (a line each)."""
    from tpuboot.notices import noticefile
    from tpuboot.notices.wait import current

    for notice in current(ctx.root) or []:
        print(f"notice: {noticefile.describe(notice)}")
