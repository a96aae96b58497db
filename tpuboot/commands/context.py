"""What every command gets: its context (the root, the configuration read when first asked
for), the exit statuses, and the shape of a --json answer."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from tpuboot.config import Config, load_config
from tpuboot.devices.vfio import Binder
from tpuboot.paths import Root

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_ABSENT = 3  # `metadata get`: the key is not set and no --default was given
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), 128 + 2 as a shell reports a command it killed


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


def print_json(data: Mapping[str, object] | Sequence[Mapping[str, object]]) -> None:
    """A --json answer: one object for one report, a list for records of one kind (doc/operation.md)."""
    import json

    print(json.dumps(data, indent=2))
