"""systemd's unit and configuration files, resolved as systemd resolves them (unit directories,
drop-ins, continuations, ``Limit*=`` values), and :class:`Systemd`, which asks ``systemctl show``
what is in force on a running host."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from tpuboot import subproc
from tpuboot.checks.parsers.files import layered, masked, read_text, texts
from tpuboot.checks.parsers.rlimits import UNLIMITED, Limit
from tpuboot.errors import TpubootError
from tpuboot.errors import shown as quoted
from tpuboot.numbers import ascii_int
from tpuboot.paths import Root

UNIT_DIRS = (
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
)
MANAGER_CONF = "/etc/systemd/system.conf"
MANAGER_DROPIN_DIRS = tuple(f"{d}.conf.d" for d in UNIT_DIRS)
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}


def parse_rlimit(text: str, source: str) -> Limit:
    """A systemd ``Limit*=`` value: ``infinity``, ``N`` (K, M, G... suffixes) or ``SOFT:HARD``."""

    def one(part: str) -> float:
        part = part.strip()
        if part == "infinity":
            return UNLIMITED
        match = re.fullmatch(r"([0-9]+)\s*([KMGTPE]?)i?B?", part)
        number = ascii_int(match.group(1)) if match else None
        if match is None or number is None:  # 20 digits at most: a float of more would overflow
            raise ValueError(f"{quoted(text)} is not a resource limit")
        return float(number * _SUFFIX[match.group(2)])

    soft, _, hard = text.partition(":")
    return Limit(one(soft), one(hard or soft), source)


def ini(text: str) -> Iterator[tuple[str, str, str]]:
    """(section, key, value) from a systemd unit or configuration file, continuations joined."""
    section, pending = "", ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif "=" in line:
            key, _, value = line.partition("=")
            yield section, key.strip(), value.strip()


def file_limits(root: Root, files: list[str], section: str, keys: dict[str, str]) -> dict[str, Limit | None]:
    """The limits ``keys`` (setting -> item: ``LimitMEMLOCK`` -> ``memlock``) give in ``section``
    of ``files`` read in order (the last setting wins, an empty one resets); None for an item none
    of them sets."""
    found: dict[str, tuple[str, str]] = {}
    for shown, text in texts(root, files):
        for sect, key, value in ini(text):
            if sect == section and key in keys:
                found[keys[key]] = (value, shown)
    out: dict[str, Limit | None] = {}
    for item in keys.values():
        value, shown = found.get(item, ("", ""))
        try:
            out[item] = parse_rlimit(value, shown) if value else None
        except ValueError:
            out[item] = Limit(None, None, f"{quoted(value)} in {shown} is unreadable")
    return out


def manager_files(root: Root) -> list[str]:
    """system.conf and its drop-ins, in the order systemd reads them."""
    return [MANAGER_CONF, *layered(root, MANAGER_DROPIN_DIRS, "*.conf")]


def unit_file(root: Root, unit: str) -> str | None:
    """The unit's file (maybe an alias symlink, read under the root), None if absent or masked."""
    path = next(
        (f"{d}/{unit}" for d in UNIT_DIRS if os.path.lexists(root.path(f"{d}/{unit}", follow=False))), None
    )
    if path is None or masked(root.path(path, follow=False)) or read_text(root, path) is None:
        return None
    return path


def unit_dropins(root: Root, unit: str) -> list[str]:
    """The unit's drop-ins and those for every unit of its kind (``service.d``), by name."""
    kind = unit.rsplit(".", 1)[-1]
    dropins = layered(root, tuple(f"{d}/{unit}.d" for d in UNIT_DIRS), "*.conf")
    dropins += layered(root, tuple(f"{d}/{kind}.d" for d in UNIT_DIRS), "*.conf")
    dropins.sort(key=os.path.basename)
    return dropins


class Systemd:
    """What systemd has in force, from ``systemctl show``; the limit checks ask it before the files.
    A test passes its own (``run_checks(systemd=...)``, ``Doctor(systemd=...)``)."""

    def live(self, root: Root) -> bool:
        """True when ``systemctl show`` can tell what is in force: the host, with systemd running."""
        return root.is_host and root.path("/run/systemd/system").is_dir()

    def show(self, unit: str | None, properties: list[str]) -> dict[str, str] | None:
        """``systemctl show`` of the manager (``unit`` None) or of a unit; None if it cannot answer."""
        argv = ["systemctl", "show", *(f"--property={p}" for p in properties), *([unit] if unit else [])]
        try:
            out = subproc.run(argv, timeout=10)
        except TpubootError:
            return None
        return dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)


SYSTEMD = Systemd()
