"""The grammar of an address tpuboot connects to on this host: ``HOST:PORT`` or a unix socket.

Read by the configuration (``vbar.endpoint``) and used by the liveness check
(tpuboot/containers/liveness.py); kept apart so that reading a configuration loads no container
code.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

#: GKE's TPU device plugin's vBar port; loopback because the agent runs on the host network and
#: tpuboot's unit may reach only localhost and the metadata server (IPAddressAllow=).
VBAR_ENDPOINT = "127.0.0.1:8353"
UNIX_PREFIX = "unix:"


class EndpointError(ValueError):
    """An endpoint that cannot be read (the configuration names the key)."""


@dataclass(frozen=True)
class Endpoint:
    """A TCP ``host:port`` or a unix socket ``path`` (absolute, inside the root)."""

    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.path:
            return f"{UNIX_PREFIX}{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT``, ``[V6]:PORT``, ``unix:/PATH`` or ``/PATH``; an IP address, not a name: a
    name would need a resolver the unit may not reach, and a lookup per tick."""
    if text.startswith(UNIX_PREFIX) or text.startswith("/"):
        path = text[len(UNIX_PREFIX) :] if text.startswith(UNIX_PREFIX) else text
        if not path.startswith("/") or "\0" in path:
            raise EndpointError(f"{text!r}: a unix socket is an absolute path, like unix:/run/vbar.sock")
        return Endpoint(path=os.path.normpath(path))
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise EndpointError(f"{text!r}: expected HOST:PORT with a port from 1 to 65535, or unix:/PATH")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise EndpointError(f"{text!r}: the host must be an IP address, like 127.0.0.1:8353") from None
    return Endpoint(host=str(address), port=int(port_text))
