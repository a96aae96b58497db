"""The parsed configuration file, kept so that a command starts without importing PyYAML.

Importing yaml is 79 M instructions (valgrind on the host, python3 3.11), a third of a whole
`tpuboot bind` with a config that sets anything, and ~0.2 s under TCG before the daemon's first
coldplug bind. So once PyYAML has read the file, its text and what ``yaml.safe_load`` made of it
are kept in ``/var/cache/tpuboot/config.json`` (under the Root), and the next load whose file
text is *exactly* the stored text takes the stored data instead (json: 4.4 M instructions). The
data goes through the same validation either way (tpuboot/config.py), so a result or an error
message is the same with or without the cache.

Why it cannot be stale: the data is a function of the text alone (and of PyYAML's SafeLoader),
and the key is the whole text, not a time stamp; the installed PyYAML's ``__init__.py`` (path,
size, mtime) is part of the key too, so an upgrade of PyYAML drops the entry. Kept only when the
round trip through JSON is exact: dicts with str keys, lists, str, int, finite float, bool, None
(YAML also makes int keys, dates, bytes, sets: such a file is parsed every time).

Never worse than no cache: a missing, unreadable, truncated, oversized, malformed or mistrusted
(a symlink, another user's, writable by others) file is a miss, logged at debug level; a failed
write (no /var/cache/tpuboot, a read-only /var, a non-root command) is ignored. Written 0600,
root's: the config file may be 0600 itself, and a copy must not be easier to read than it; the
commands that load it (bind, run, prepare-image) run as root, any other simply parses.
Deleting the file drops the cache.
"""

from __future__ import annotations

import logging
import math
import os
import stat

from tpuboot import __version__
from tpuboot.errors import TpubootError
from tpuboot.paths import Root

TYPE_CHECKING = False  # as in tpuboot.config: typing stays out of `tpuboot bind`
if TYPE_CHECKING:
    from typing import Any

log = logging.getLogger("tpuboot.config")

CACHE_PATH = "/var/cache/tpuboot/config.json"
#: Bump when tpuboot changes how it turns the text into data (another loader, pre-processing).
FORMAT = 1
#: A config file is a few KiB; a record larger than this is not written, nor read.
MAX_BYTES = 1 << 20
#: The most values one record holds: YAML aliases can make a small file a huge tree.
MAX_NODES = 50_000
MODE = 0o600

#: What lookup returns when there is no usable record (None is a valid parse: a file of `~`).
MISS: Any = object()


def lookup(root: Root, text: str) -> Any:
    """What PyYAML made of ``text`` last time, or MISS."""
    raw = _read(root)
    if raw is None:
        return MISS
    import json

    try:
        record = json.loads(raw, parse_constant=_refuse)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError included
        log.debug("config cache %s is not a record (%s); parsing the file", CACHE_PATH, type(exc).__name__)
        return MISS
    if not (
        isinstance(record, dict)
        and type(record.get("format")) is int
        and record["format"] == FORMAT
        and record.get("tpuboot") == __version__
        and "data" in record
    ):
        log.debug("config cache %s has another shape or format; parsing the file", CACHE_PATH)
        return MISS
    if record.get("text") != text or record.get("yaml") != _yaml_stamp():
        return MISS  # the file (or PyYAML) changed: the next parse replaces the record
    return record["data"]


def store(root: Root, text: str, data: Any) -> None:
    """Keep ``data`` (PyYAML's result for ``text``) if it survives JSON exactly; never raises."""
    stamp = _yaml_stamp()
    if stamp is None or not plain(data):
        return
    import json

    try:
        payload = json.dumps(
            {"format": FORMAT, "tpuboot": __version__, "yaml": stamp, "text": text, "data": data},
            ensure_ascii=True,
            allow_nan=False,
            separators=(",", ":"),
        ).encode("ascii")
    except (ValueError, RecursionError):  # an int too long for this Python's str()
        return
    if len(payload) > MAX_BYTES or not _may_write(root):
        return
    from tpuboot.atomicfile import write_file  # only here: 29 M instructions, a miss's cost

    try:
        write_file(root, CACHE_PATH, payload, mode=MODE)
    except (TpubootError, OSError) as exc:  # FileWriteError is a TpubootError
        log.debug("config cache %s not written: %s", CACHE_PATH, exc)


def plain(data: Any) -> bool:
    """True if ``data`` is JSON's types only, so that dumping and loading it gives it back equal
    and of the same types (no int keys turned into str, no tuples into lists, no NaN)."""
    todo = [data]
    seen = 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > MAX_NODES:  # also ends a cycle (`&a [*a]`)
            return False
        kind = type(item)
        if item is None or kind is str or kind is bool or kind is int:
            continue
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is list:
            todo.extend(item)
        elif kind is dict:
            if not all(type(key) is str for key in item):
                return False
            todo.extend(item.values())
        else:
            return False
    return True


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not a finite number")


def _trusted(st: os.stat_result) -> bool:
    """Made by root or by us, and writable by no one else (atomicfile's rule, without its import)."""
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _read(root: Root) -> bytes | None:
    """The record's bytes, or None: no symlink followed at the file or its directory, capped."""
    real = root.path(CACHE_PATH, follow=False)  # the links above the directory resolved under the root
    try:
        parent = os.open(
            root.path(os.path.dirname(CACHE_PATH), follow=False),
            os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
        )
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.debug("config cache %s: %s; parsing the file", CACHE_PATH, exc)
        return None
    try:
        if not _trusted(os.fstat(parent)):
            log.debug("config cache %s: its directory is writable by others; parsing the file", CACHE_PATH)
            return None
        fd = os.open(real.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.debug("config cache %s: %s; parsing the file", CACHE_PATH, exc)
        return None
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _trusted(st) or st.st_size > MAX_BYTES:
            log.debug(
                "config cache %s: not a regular file of ours, or too large; parsing the file", CACHE_PATH
            )
            return None
        chunks, total = [], 0
        while total <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks) if total <= MAX_BYTES else None
    except OSError as exc:
        log.debug("config cache %s: %s; parsing the file", CACHE_PATH, exc)
        return None
    finally:
        os.close(fd)


def _may_write(root: Root) -> bool:
    """Whether a write can succeed, judged without importing atomicfile: the nearest existing
    directory on the cache's path is writable (not a read-only /var, not root's for a user)."""
    here = root.path(CACHE_PATH).parent
    while not here.exists() and here != here.parent:
        here = here.parent
    return os.access(here, os.W_OK)


def _yaml_stamp() -> list[Any] | None:
    """The installed PyYAML, without importing it: its ``__init__.py``'s path, size and mtime."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("yaml")
        origin = spec.origin if spec is not None else None
        if origin is None:
            return None
        st = os.stat(origin)
    except (ImportError, ValueError, OSError):
        return None
    return [origin, st.st_size, st.st_mtime_ns]
