"""``tpuboot metadata get``: one key of the instance's or the project's metadata, checked first."""

from __future__ import annotations

from typing import Protocol

from tpuboot.errors import UsageError
from tpuboot.gce.keys import INSTANCE, KINDS, is_path
from tpuboot.gce.replies import Reply


class MetadataReader(Protocol):
    """What is used of the client (:class:`tpuboot.gce.client.MetadataClient`)."""

    def get(self, path: str, *, deadline_s: float) -> Reply: ...


def metadata_get(client: MetadataReader, kind: str, key: str, *, deadline_s: float = 15.0) -> str:
    """The text of one metadata key, for ``tpuboot metadata get``; MetadataAbsent if it does not exist."""
    if kind not in KINDS:
        raise UsageError(f"unknown metadata type {kind!r}; use one of {', '.join(KINDS)}")
    path = KINDS[kind] + key
    if not key or not is_path(path):
        raise UsageError(
            f"{key!r} is not a metadata key; use letters, digits, '-', '_', '.' (and '/' for instance)"
        )
    if KINDS[kind] != INSTANCE and "/" in key:
        raise UsageError(f"{key!r}: attribute names have no '/'; use --type instance for paths")
    return client.get(path, deadline_s=deadline_s).text
