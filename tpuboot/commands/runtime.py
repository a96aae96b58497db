"""What the chips are doing as their libtpu reports it: `top` (tpuboot/runtime/, doc/runtime-metrics.md)."""

from __future__ import annotations

import argparse

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json


def cmd_top(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.runtime.top import as_dict, healthy, look, render

    snapshot = look(ctx.root, ctx.config)
    if args.json:
        print_json(as_dict(snapshot))
    else:
        print("\n".join(render(snapshot)))
    return EXIT_OK if healthy(snapshot) else EXIT_FAILED
