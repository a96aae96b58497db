"""Bare TCP listeners on 127.0.0.1 that misbehave as a peer can: one that accepts and never says
a word (:class:`Silent`: a hung libtpu, or vBar's stand-in whose connections a test drives), one
that resets every connection (:class:`Resetting`)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class Listener:
    """A TCP listener on 127.0.0.1 whose connections are handled by :meth:`handle`."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop_listening(self) -> None:
        """The peer goes away: shutdown wakes the accept in flight, which would keep the port listening."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def close(self) -> None:
        self.stop_listening()
        for conn in self.accepted:
            conn.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Silent(Listener):
    """Accepts every connection, keeps it in :attr:`accepted` and never says a word."""

    def handle(self, conn: socket.socket) -> None:
        self.accepted.append(conn)


class Resetting(Listener):
    """Resets every connection as soon as it is accepted (SO_LINGER 0: a RST, not a FIN)."""

    def handle(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
