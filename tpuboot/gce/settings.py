"""The metadata server's address and the client's limits: plain values, taken from the
configuration by the caller (tpuboot/wiring.py, doctor, the CLI), so this package needs no config.

Address ``169.254.169.254``, not ``metadata.google.internal``: DNS may not work yet at boot.
``GCE_METADATA_HOST`` (host[:port]; the older name ``GCE_METADATA_ROOT`` too) overrides it as in
google-auth and google-cloud-go, and **wins over** the config key ``metadata.host``: the
environment is the per-run override (tests, one-off commands), the file the standing default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from tpuboot.errors import ConfigError
from tpuboot.gce.keys import API_ROOT
from tpuboot.paths import MAX_FILE_BYTES

DEFAULT_HOST = "169.254.169.254"
DEFAULT_URL = f"http://{DEFAULT_HOST}/{API_ROOT}"
HOST_ENV = "GCE_METADATA_HOST"
LEGACY_HOST_ENV = "GCE_METADATA_ROOT"
#: Each try's deadline (s) and the largest body read: the defaults of config ``metadata.timeout``
#: and ``metadata.max_body``, and of a client built without a config.
DEFAULT_TIMEOUT = 5.0
DEFAULT_MAX_BODY = MAX_FILE_BYTES
#: A watch never asks more often than this (seconds), whatever the server answers.
MIN_POLL_INTERVAL = 1.0

_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?\Z")


@dataclass(frozen=True)
class MetadataSettings:
    """``host`` (None: the default), each try's ``timeout`` (s) and the largest body read (bytes):
    the config's ``metadata`` section as the client uses it."""

    host: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    max_body: int = DEFAULT_MAX_BODY


def metadata_base_url(config_host: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The server's base URL: ``$GCE_METADATA_HOST`` over config ``metadata.host`` over 169.254.169.254."""
    env = os.environ if environ is None else environ
    from_env = env.get(HOST_ENV) or env.get(LEGACY_HOST_ENV)
    host = from_env or config_host or DEFAULT_HOST
    if not _HOST.match(host):
        where = f"${HOST_ENV}" if from_env else "metadata.host"
        raise ConfigError(
            f"{where}: {host!r} is not host[:port]; write it like 169.254.169.254 or 127.0.0.1:8080"
        )
    return f"http://{host}/{API_ROOT}"
