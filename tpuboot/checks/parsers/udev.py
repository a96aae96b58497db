"""udev rules files: where udev finds them and each rule as its (key, operator, value) tokens."""

from __future__ import annotations

import re
from collections.abc import Iterator

UDEV_RULES_DIRS = (
    "/etc/udev/rules.d",
    "/run/udev/rules.d",
    "/usr/local/lib/udev/rules.d",
    "/usr/lib/udev/rules.d",
    "/lib/udev/rules.d",
)
#: Where udev runs a RUN program named without a directory from.
UDEV_PROGRAM_DIRS = ("/lib/udev", "/usr/lib/udev")
_TOKEN = re.compile(r'([A-Z_]+(?:\{[^}]*\})?)\s*(==|!=|\+=|-=|:=|=)\s*"([^"]*)"')

Rule = list[tuple[str, str, str]]


def udev_rules(text: str) -> Iterator[Rule]:
    """Each rule in a rules file as its (key, operator, value) tokens."""
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        pending = ""
        if line and not line.startswith("#"):
            yield _TOKEN.findall(line)


def run_programs(rule: Rule) -> list[str]:
    """The program of each RUN assignment (``RUN{program}`` too; not ``RUN{builtin}``)."""
    programs = []
    for key, op, value in rule:
        if key in ("RUN", "RUN{program}") and op in ("=", "+=", ":=") and value.split():
            programs.append(value.split()[0])
    return programs


def program_paths(program: str) -> list[str]:
    """Where udev looks for ``program``: itself if absolute, else in its own directories."""
    return [program] if program.startswith("/") else [f"{d}/{program}" for d in UDEV_PROGRAM_DIRS]
