"""What runs at boot in an image, for the leftover checks: cloud-init's configuration and scripts
(per-boot, per-instance, per-once, the current instance's user-data, NoCloud seeds baked into the
image), rc.local, cron and the admin's units; the scripts in the directories such files name; and
the paths a runner names. Files tpuboot knows nothing about are read quietly: one it cannot read
(absent, big, not text) is left out, never an error."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from tpuboot.checks.parsers.files import read_text
from tpuboot.errors import TpubootError
from tpuboot.paths import Root

#: Where the procedure's boot-time scripts live (its write_files targets) and where such scripts
#: are commonly kept: a script here runs only if something names it.
SCRIPT_DIRS = ("/var/scripts", "/usr/local/bin", "/usr/local/sbin", "/lib/udev", "/usr/lib/udev")
#: What runs at boot and may run a leftover: cloud-init's configuration, per-boot/instance/once
#: scripts, the current instance's user-data and generated scripts, NoCloud seeds baked into the
#: image, rc.local, cron and the admin's units.
RUNNER_FILES = (
    "/etc/cloud/cloud.cfg",
    "/etc/rc.local",
    "/etc/crontab",
    "/var/lib/cloud/seed/nocloud/user-data",
    "/var/lib/cloud/seed/nocloud-net/user-data",
)
RUNNER_DIRS = (
    "/etc/cloud/cloud.cfg.d",
    "/var/lib/cloud/scripts/per-boot",
    "/var/lib/cloud/scripts/per-instance",
    "/var/lib/cloud/scripts/per-once",
    "/etc/cron.d",
    "/etc/systemd/system",
)
CLOUD_INSTANCE_LINK = "/var/lib/cloud/instance"  # -> instances/<id>: this instance's files
CLOUD_INSTANCE_FILES = ("user-data.txt", "cloud-config.txt", "vendor-data.txt")
_NOT_FILES = ("/proc/", "/sys/", "/dev/", "/run/")
_NAMED_PATH = re.compile(r"(?<![\w$}])/[\w.+@-]+(?:/[\w.+@-]+)+")
MAX_NAMED_PATHS = 64  # paths named in one runner that are followed to their scripts
MAX_SCRIPT_BYTES = 256 << 10  # bigger files (dockerd, udev's hwdb.bin) are no boot script: not read


def own(path: str) -> bool:
    """One of tpuboot's own files (its name holds "tpuboot"): never a leftover."""
    return "tpuboot" in os.path.basename(path)


def read_quiet(root: Root, path: str) -> str | None:
    """``path``'s text, or None when it is absent, not a regular file, big, unreadable or not
    text: a leftover scan reads files it knows nothing about and judges only those it can read."""
    try:
        if root.path(path).stat().st_size > MAX_SCRIPT_BYTES:
            return None
        return read_text(root, path)
    except (TpubootError, OSError, UnicodeDecodeError):
        return None


def _files_in(root: Root, directory: str) -> list[str]:
    """The regular files directly in ``directory`` under the root, sorted (none if absent)."""
    real = root.path(directory)
    if not real.is_dir():
        return []
    return sorted(f"{directory}/{e.name}" for e in real.iterdir() if not e.is_symlink() and e.is_file())


def _cloud_instance(root: Root) -> str | None:
    """The current cloud-init instance directory (the link's target, read under the root)."""
    link = root.path(CLOUD_INSTANCE_LINK, follow=False)
    if not link.is_symlink():
        return CLOUD_INSTANCE_LINK if link.is_dir() else None
    target = os.readlink(link)
    if not target.startswith("/"):
        target = os.path.normpath(f"{os.path.dirname(CLOUD_INSTANCE_LINK)}/{target}")
    return target if root.path(target).is_dir() and not root.path(target, follow=False).is_symlink() else None


def runners(root: Root) -> Iterator[tuple[str, str]]:
    """(path, text) of every file that runs something at boot, tpuboot's own left out."""
    paths = list(RUNNER_FILES)
    for directory in RUNNER_DIRS:
        paths += _files_in(root, directory)
    instance = _cloud_instance(root)
    if instance is not None:
        paths += [f"{instance}/{name}" for name in CLOUD_INSTANCE_FILES]
        paths += _files_in(root, f"{instance}/scripts")
    seen: set[str] = set()
    for path in paths:
        if path in seen or own(path):
            continue
        seen.add(path)
        text = read_quiet(root, path)
        if text is not None:
            yield path, text


def scripts(root: Root) -> Iterator[tuple[str, str]]:
    """(path, text) of the files in SCRIPT_DIRS, each real file once (/lib may be /usr/lib)."""
    seen: set[str] = set()
    for directory in SCRIPT_DIRS:
        for path in _files_in(root, directory):
            real = root.resolve(path)
            if real in seen or own(path):
                continue
            seen.add(real)
            text = read_quiet(root, path)
            if text is not None:
                yield path, text


def named_paths(text: str) -> list[str]:
    """The file paths a runner's text names (not /proc, /sys, /dev or /run), first
    :data:`MAX_NAMED_PATHS`, each once, in order."""
    named = [p for p in dict.fromkeys(_NAMED_PATH.findall(text)) if not p.startswith(_NOT_FILES)]
    return named[:MAX_NAMED_PATHS]
