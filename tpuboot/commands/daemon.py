"""`tpuboot run`: the daemon, built by the composition root (tpuboot/wiring.py)."""

from __future__ import annotations

import argparse
import logging

from tpuboot.commands.context import Context
from tpuboot.config import Config
from tpuboot.errors import ConfigError

log = logging.getLogger("tpuboot.cli")


def cmd_run(ctx: Context, args: argparse.Namespace) -> int:
    from tpuboot.signals import hold_until_served

    hold_until_served()  # until the loop gives each signal its meaning (tpuboot/signals.py)
    from tpuboot.allocator import fix_mmap_threshold

    fix_mmap_threshold()  # a daemon that lives for months: large blocks go back whole
    try:
        config = ctx.config
    except ConfigError as exc:  # a daemon that exits on a typo leaves the TPUs unbound
        log.error("%s; running with built-in defaults", exc)
        config = Config()
    from tpuboot.wiring import build  # binds the TPUs present while the rest loads

    return build(ctx.root, config).serve()
