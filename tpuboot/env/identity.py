"""Which instance this machine is, without the network: the SMBIOS system UUID.

GCE sets it per instance (``/sys/class/dmi/id/product_uuid``), QEMU with ``-uuid``. It is what
cloud-init trusts offline for the same question (its datasources' ``check_instance_id`` compares
the cached instance-id with the DMI system UUID without the network); google-guest-agent compares
metadata's ``instance/id`` with a stored one, which needs the server, so it cannot help when the
server is silent. The tpu-env cache (tpuboot/env/cache.py) is used only on the instance it names.
"""

from __future__ import annotations

import re

from tpuboot.paths import Root

#: The SMBIOS system UUID: set per instance by GCE (and QEMU's ``-uuid``), readable by root only.
PRODUCT_UUID_PATH = "/sys/class/dmi/id/product_uuid"
#: A system UUID as tpuboot stores it (lower case).
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: What firmware puts there when it has no UUID to give: never an instance's identity.
_NO_UUID = frozenset({"00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"})


def instance_identity(root: Root) -> str | None:
    """This machine's SMBIOS system UUID in lower case, or None when it has none worth trusting."""
    try:
        with open(root.path(PRODUCT_UUID_PATH), "rb") as file:
            raw = file.read(128)
    except OSError:
        return None
    text = raw.decode("ascii", "replace").strip().lower()
    if not UUID.fullmatch(text) or text in _NO_UUID:
        return None
    return text
