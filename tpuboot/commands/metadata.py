"""What reads the metadata server by hand: `metadata get` and `env` (tpu-env once)."""

from __future__ import annotations

import argparse
import sys

from tpuboot.commands.context import EXIT_ABSENT, EXIT_FAILED, EXIT_OK, Context


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
