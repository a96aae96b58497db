"""Walking the CLI's argparse tree: the docs tests and the import-list test name the same commands."""

from __future__ import annotations

import argparse
from collections.abc import Iterator


def commands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``metadata get``, its parser) for every command that runs something."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix}{name}"
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from commands(sub, path + " ")
                else:
                    yield path, sub
