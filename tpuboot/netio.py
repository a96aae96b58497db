"""Network reads that end on time: shared by metadata and dockerapi.

Why: a socket timeout bounds one receive, not a request. A server that is up but sends its
status line, headers or body a byte at a time, each just inside the timeout, holds a request
for as long as it likes (urllib3's ``Timeout(total=)`` only caps each receive's timeout by
what was left when the request was sent). :class:`DeadlineSocket` re-arms the timeout before
every receive and send to what is left of a wall-clock deadline, so a whole request, headers
and body, ends by it whichever library reads the socket.

Numbers from the network are read by :func:`tpuboot.numbers.ascii_int`, as every number another
party wrote.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


class DeadlineSocket(socket.socket):
    """A socket whose receives and sends end by the deadline ``deadline()`` gives (None: no deadline).

    ``settimeout`` keeps its meaning (the longest one receive may wait); before each operation
    the timeout is lowered to what is left of the deadline, and past it the operation raises
    ``TimeoutError`` as a socket timeout would.
    """

    def __init__(
        self, *args: object, deadline: Callable[[], float | None] = lambda: None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._deadline = deadline
        self._per_operation: float | None = None

    @classmethod
    def adopt(cls, sock: socket.socket, deadline: Callable[[], float | None]) -> DeadlineSocket:
        """The connected ``sock`` as a DeadlineSocket (``sock`` is detached: use the result)."""
        timeout = sock.gettimeout()
        adopted = cls(sock.family, sock.type, sock.proto, fileno=sock.detach(), deadline=deadline)
        adopted.settimeout(timeout)
        return adopted

    def settimeout(self, value: float | None) -> None:
        self._per_operation = value
        super().settimeout(value)

    def _arm(self) -> None:
        deadline = self._deadline()
        if deadline is None:
            super().settimeout(self._per_operation)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out (the request's deadline passed)")
        per = self._per_operation
        super().settimeout(left if per is None else min(per, left))

    def recv(self, *args: int) -> bytes:
        self._arm()
        return super().recv(*args)

    def recv_into(self, *args: object) -> int:
        self._arm()
        return super().recv_into(*args)  # type: ignore[arg-type]

    def sendall(self, *args: object) -> None:
        self._arm()
        super().sendall(*args)  # type: ignore[arg-type]

    def send(self, *args: object) -> int:
        self._arm()
        return super().send(*args)  # type: ignore[arg-type]
