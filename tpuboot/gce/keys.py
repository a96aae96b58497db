"""Where things are in the metadata tree: the one source of every path tpuboot asks for.

Paths are relative to the server's :data:`API_ROOT` (its address: :mod:`tpuboot.gce.settings`). Imports
nothing heavy: the CLI's argument parser reads :data:`KINDS`.
"""

from __future__ import annotations

import re

#: Where the tree starts on the server, and so in every URL of it (and in a script that asks it).
API_ROOT = "computeMetadata/v1/"
#: The instance's and the project's custom metadata (attributes).
INSTANCE_ATTRIBUTES = "instance/attributes/"
PROJECT_ATTRIBUTES = "project/attributes/"
#: The instance's own data (``instance/id``, ``instance/service-accounts/...``).
INSTANCE = "instance/"
#: Where a guest writes its attributes: ``instance/guest-attributes/NAMESPACE/KEY``.
GUEST_ATTRIBUTES = "instance/guest-attributes/"
#: The tpu-env attribute the TPU VM's runtime environment comes from.
TPU_ENV = INSTANCE_ATTRIBUTES + "tpu-env"
#: ``projects/NUMBER/machineTypes/NAME``: which TPU machine this is (doctor's slice check).
MACHINE_TYPE = INSTANCE + "machine-type"
#: A slice's worker of this VM (``0``..), and every worker as ``NAME:ID:IP`` separated by commas: the
#: TPU API sets both on each VM of a multi-host slice (``tpuboot slice``).
WORKER_NUMBER = INSTANCE_ATTRIBUTES + "agent-worker-number"
WORKER_ENDPOINTS = INSTANCE_ATTRIBUTES + "worker-network-endpoints"
#: This VM's own address on its first network interface (where its peers reach it).
OWN_ADDRESS = INSTANCE + "network-interfaces/0/ip"
#: An OAuth access token of the VM's default service account (registry credentials).
SERVICE_ACCOUNT_TOKEN = INSTANCE + "service-accounts/default/token"

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
