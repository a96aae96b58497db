"""A host name resolved within a bound: the C resolver has no timeout of its own to give."""

from __future__ import annotations

import ipaddress
import socket
import threading

#: Seconds a name may take to resolve.
RESOLVE_TIMEOUT = 5.0


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT, family: int = socket.AF_INET) -> str | None:
    """``host``'s first address of ``family`` (an address is itself), None if it does not resolve
    within ``timeout``: a resolver that hangs is given up on, its daemon thread left to end alone."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return (
            str(ip)
            if family == socket.AF_UNSPEC or ip.version == (4 if family == socket.AF_INET else 6)
            else None
        )
    answer: list[str] = []

    def ask() -> None:
        try:
            infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return
        answer.extend(str(info[4][0]) for info in infos[:1])

    asker = threading.Thread(target=ask, name="slice-resolve", daemon=True)
    asker.start()
    asker.join(timeout)
    return answer[0] if answer else None
