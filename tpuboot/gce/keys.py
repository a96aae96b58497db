"""Where things are in the metadata tree: the one source of every path tpuboot asks for.

Paths are relative to the server's ``computeMetadata/v1/`` (:mod:`tpuboot.gce.settings`). Imports
nothing heavy: the CLI's argument parser reads :data:`KINDS`.
"""

from __future__ import annotations

import re

#: The instance's and the project's custom metadata (attributes).
INSTANCE_ATTRIBUTES = "instance/attributes/"
PROJECT_ATTRIBUTES = "project/attributes/"
#: The instance's own data (``instance/id``, ``instance/service-accounts/...``).
INSTANCE = "instance/"
#: Where a guest writes its attributes: ``instance/guest-attributes/NAMESPACE/KEY``.
GUEST_ATTRIBUTES = "instance/guest-attributes/"
#: The tpu-env attribute the TPU VM's runtime environment comes from.
TPU_ENV = INSTANCE_ATTRIBUTES + "tpu-env"

#: Where ``tpuboot metadata get --type KIND KEY`` looks.
KINDS = {
    "attributes": INSTANCE_ATTRIBUTES,
    "project-attributes": PROJECT_ATTRIBUTES,
    "instance": INSTANCE,
}

_SEGMENT = r"[A-Za-z0-9_.-]+"
_PATH = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*/?\Z")


def is_path(path: str) -> bool:
    """Whether ``path`` is a relative metadata path: segments of letters, digits, '-', '_', '.',
    none of them '.' or '..' (nothing climbs out of ``computeMetadata/v1/``)."""
    return bool(_PATH.match(path)) and not any(part in (".", "..") for part in path.split("/"))
