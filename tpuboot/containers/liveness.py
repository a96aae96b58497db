"""Whether a running agent answers: vBar's control endpoint accepts connections, or it does not.

libtpu reaches vBar at ``VBAR_CONTROL_SERVICE_URL``: a TCP port on the node (8353, as GKE's TPU
device plugin sets it) or a unix socket (``/var/run/tpu-plugin/vbar.sock`` there). A container that
runs but no longer accepts there looks healthy to ``docker ps`` while every job's ICI set-up
fails, so tpuboot connects to the endpoint once per daemon tick while the container runs (a
connect and a close: nothing is sent, so no protocol is assumed) and says when it stops answering.
Restarting the container for it is off unless ``vbar.restart_unanswered_after`` is set: the
endpoint is the device plugin's, not documented for a VM, so an image builder confirms it first.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from tpuboot.endpoints import Endpoint
from tpuboot.paths import Root

#: A loopback or local-socket connect answers in microseconds; longer is a wedged listener.
CONNECT_TIMEOUT = 2.0


#: ``probe(endpoint, root)``: None when it accepts a connection, else why not (tests give their own).
EndpointProbe = Callable[[Endpoint, Root], "str | None"]


def probe(endpoint: Endpoint, root: Root, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """None when the endpoint accepts a connection, else why not, in a few words."""
    if endpoint.path:
        family, address = socket.AF_UNIX, str(root.path(endpoint.path))
        if len(os.fsencode(address)) > 107:  # sun_path: the kernel would refuse it
            return f"socket path too long under the root ({address})"
    else:
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        address = (endpoint.host, endpoint.port)  # type: ignore[assignment]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return "no such socket"
        return (exc.strerror or str(exc)).lower()
    return None


@dataclass
class Liveness:
    """One agent's answers over time: since when it has not answered, and whether that is long
    enough to restart it. Fed from one thread (the pool's check), read under the caller's lock."""

    endpoint: Endpoint
    #: Restart after this long unanswered; 0: never.
    restart_after: float = 0.0
    problem: str | None = None  # the last probe's, None while it answers or before the first
    failing_since: float | None = None
    checked: bool = False

    def observe(self, problem: str | None, now: float) -> bool:
        """One probe's outcome; True when the agent's container is due a restart for it."""
        self.checked = True
        self.problem = problem
        if problem is None:
            self.failing_since = None
            return False
        if self.failing_since is None:
            self.failing_since = now
        return bool(self.restart_after) and now - self.failing_since >= self.restart_after

    def forget(self) -> None:
        """The container stopped or was restarted: its successor is judged afresh."""
        self.problem, self.failing_since, self.checked = None, None, False

    @property
    def answering(self) -> bool | None:
        """True or False after a probe of the running container; None before one."""
        return None if not self.checked else self.problem is None

    def detail(self) -> str:
        """What STATUS adds to ``running``: nothing while it answers or before a probe. No clock in
        it, so STATUS (and the guest attribute) change when the answer does, not at every tick."""
        if self.problem is None:
            return ""
        return f", not answering at {self.endpoint} ({self.problem})"
