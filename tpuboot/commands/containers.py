"""Containers without --privileged: `cdi`, the spec the daemon keeps
(doc/containers-without-privileged.md)."""

from __future__ import annotations

import argparse
import sys

from tpuboot.commands.context import EXIT_OK, Context
from tpuboot.errors import TpubootError, UsageError


def cmd_cdi(ctx: Context, args: argparse.Namespace) -> int:
    """The CDI spec the daemon keeps, read from sysfs now: printed, or written to --output (under
    --root, a file in the tree, as every path tpuboot touches there)."""
    import os

    from tpuboot.atomicfile import write_file
    from tpuboot.containers.cdi import host_spec, to_json, to_yaml

    spec = host_spec(ctx.root, ctx.config, ctx.binder())
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
