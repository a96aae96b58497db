"""Configuration files under a :class:`~tpuboot.paths.Root` as their readers merge them: one file's
text, and the files of several directories layered as systemd and udev layer them (the first
directory holding a name wins, a name masked by a link to /dev/null drops out)."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from pathlib import Path

from tpuboot.atomicfile import read_file
from tpuboot.paths import Root


def read_text(root: Root, path: str) -> str | None:
    """The text of ``path`` under ``root`` (absolute symlinks followed under it, as in an image
    tree), or None if it does not exist."""
    data = read_file(root, path)
    return None if data is None else data.decode("utf-8")


def masked(path: Path) -> bool:
    """A symlink to /dev/null: hides the files of that name in lower-priority directories."""
    return path.is_symlink() and os.readlink(path) == "/dev/null"


def layered(root: Root, dirs: tuple[str, ...], pattern: str) -> list[str]:
    """Files matching ``pattern`` in ``dirs`` (highest priority first), as systemd and udev merge
    them: the first directory holding a name wins, masked names drop out, sorted by name."""
    chosen: dict[str, Path] = {}
    for directory in dirs:
        real = root.path(directory)
        if not real.is_dir():
            continue
        for entry in real.iterdir():
            if entry.name not in chosen and fnmatch.fnmatchcase(entry.name, pattern):
                chosen[entry.name] = entry
    return [
        root.strip(path)
        for _, path in sorted(chosen.items())
        if not masked(path) and not root.path(root.strip(path)).is_dir()  # a link resolved under the root
    ]


def texts(root: Root, paths: list[str]) -> Iterator[tuple[str, str]]:
    """(path, text) of each of ``paths`` that exists."""
    for path in paths:
        text = read_text(root, path)
        if text is not None:
            yield path, text
