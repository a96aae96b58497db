"""The tpu-env cache: the last good raw YAML, so a boot with the metadata server down still writes tpu-env.

``env.cache_dir/tpu-env.json`` holds the value with its ETag, fetch time and the instance it was
fetched on. It is used only on the instance that wrote it: a disk captured from a running TPU VM
would otherwise give every clone its parent's tpu-env (WORKER_ID among others), and since the
cache is read only when the metadata server is silent, the identity must be local
(:mod:`tpuboot.env.identity`). A record with another UUID, one with none (format 1, written by an
older tpuboot), or any record on a machine without a usable UUID (absent, unreadable, all zeros)
is not used: on an upgraded VM that costs at most the fallback of one offline boot before the next
good fetch rewrites the record, while using it on a clone is exactly the bug. :func:`read_cache` is
the one reader (doctor uses it too); a record of the wrong shape counts as corrupt.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass

from tpuboot.atomicfile import FileReadError, read_file
from tpuboot.config import Config
from tpuboot.env.identity import PRODUCT_UUID_PATH, UUID, instance_identity
from tpuboot.paths import Root

CACHE_NAME = "tpu-env.json"
#: 2: the record names its instance (``product_uuid``); 1 (older tpuboot): it does not.
CACHE_FORMAT = 2
CACHE_MODE = 0o600


@dataclass(frozen=True)
class Cached:
    """A cache record: the raw YAML, its ETag, when it was fetched and on which instance."""

    yaml: str
    etag: str | None
    fetched: str  # ISO 8601 UTC
    product_uuid: str | None  # the instance that fetched it (None: a format-1 record)


@dataclass(frozen=True)
class CacheState:
    """The cache as this instance sees it: ``cached`` when usable, else why not (``problem``).
    Both None: there is no record."""

    cached: Cached | None
    problem: str | None = None


def cache_path(config: Config) -> str:
    return config.env.cache_dir.rstrip("/") + "/" + CACHE_NAME


def read_cache(root: Root, config: Config) -> CacheState:
    """The cache record if it is this instance's, else the reason it is not used; logs nothing."""
    path = cache_path(config)
    try:
        raw = read_file(root, path, limit=8 * max(config.metadata.max_body, 1 << 16))
    except FileReadError as exc:
        return CacheState(None, f"tpu-env cache: {exc}")
    if raw is None:
        return CacheState(None)
    record = parse_record(raw)
    if record is None:
        return CacheState(None, f"tpu-env cache {path} is corrupt")
    here = instance_identity(root)
    if here is None:
        return CacheState(
            None,
            f"tpu-env cache {path}: this machine has no usable system UUID ({PRODUCT_UUID_PATH}), "
            "so tpuboot cannot tell whether the record is its own",
        )
    if record.product_uuid is None:
        return CacheState(
            None,
            f"tpu-env cache {path} does not name its instance (an older tpuboot wrote it, "
            "perhaps on the image's build VM, or this machine had no system UUID then)",
        )
    if here != record.product_uuid:
        return CacheState(
            None,
            f"tpu-env cache {path} belongs to another instance (system UUID {record.product_uuid}, "
            f"this one is {here}: a disk cloned or moved from it)",
        )
    return CacheState(record)


def parse_record(raw: bytes) -> Cached | None:
    """A record of either format, or None if it is not one (bad JSON, a field missing or mistyped)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; "[[[[..." nested deep
        return None
    if not isinstance(record, dict):
        return None
    yaml, etag, fetched = record.get("tpu_env"), record.get("etag"), record.get("fetched")
    form, uuid = record.get("format"), record.get("product_uuid")
    if form not in (1, CACHE_FORMAT) or isinstance(form, bool):
        return None
    if (
        not isinstance(yaml, str)
        or not isinstance(fetched, str)
        or not (etag is None or isinstance(etag, str))
    ):
        return None
    if form == 1:
        return Cached(yaml, etag, fetched, None)
    if uuid is not None and not (isinstance(uuid, str) and UUID.fullmatch(uuid)):
        return None
    return Cached(yaml, etag, fetched, uuid)  # None: written on a machine without a system UUID


def encode_record(text: str, etag: str | None, fetched: datetime.datetime, product_uuid: str | None) -> bytes:
    """A format-2 record of ``text``, fetched at ``fetched`` on the instance ``product_uuid``."""
    record = {
        "format": CACHE_FORMAT,
        "product_uuid": product_uuid,
        "fetched": fetched.isoformat(),
        "etag": etag,
        "tpu_env": text,
    }
    return (json.dumps(record, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def root_only(root: Root, config: Config) -> tuple[bool, str | None]:
    """Whether only tpuboot's user (or root) can have written the cache: its directory and the file
    (if present) are theirs and writable by no one else; when not, the path someone else owns or
    may write (None: one could not be read). A cache_dir moved somewhere shared is still used for
    tpu-env, never for what tpuboot runs as root."""
    for path in (config.env.cache_dir, cache_path(config)):
        try:
            st = os.lstat(root.path(path, follow=False))
        except FileNotFoundError:
            continue
        except OSError:
            return False, None
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            return False, path
    return True, None


def short_time(iso: str) -> str:
    """``2026-11-29T20:00Z`` from a stored timestamp (as given if it does not parse)."""
    try:
        when = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
