"""The checks: `image-check`, `prepare-image`, `doctor`, and `npd` (node-problem-detector's
plugin protocol, which is not the CLI's)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpuboot.commands.context import EXIT_FAILED, EXIT_OK, Context, print_json
from tpuboot.errors import TpubootError, UsageError

if TYPE_CHECKING:
    from tpuboot.verdicts import CheckResult

log = logging.getLogger("tpuboot.cli")


def cmd_image_check(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.checks.image import run_checks

    return report(run_checks(ctx.root, [p for text in args.only for p in text.split(",") if p]), args.json)


def cmd_doctor(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.checks.doctor import Doctor, failed_required, metadata_lookup

    config = ctx.config
    lookup = metadata_lookup(config.metadata) if ctx.root.is_host else None
    verdicts = Doctor(ctx.root, config, metadata=lookup).run()
    if args.json:
        print_json([v.as_dict() for v in verdicts])
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


def cmd_prepare_image(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.prepare import prepare

    return report(prepare(ctx.root, ctx.config), args.json)


def report(results: Sequence[CheckResult], as_json: bool) -> int:
    """image-check's and prepare-image's output: one line per result, the fix after a FAIL or WARN."""
    if as_json:
        print_json([r.as_dict() for r in results])
    else:
        for r in results:
            fix = f"  fix: {r.fix}" if r.status in ("FAIL", "WARN") and r.fix else ""
            print(f"{r.status:<4}  {r.name}: {r.detail}{fix}")
    return EXIT_FAILED if any(r.status == "FAIL" for r in results) else EXIT_OK
