"""A slice peer for the namespace tests: listens on ADDRESS at each PORT, accepts every connection
and never answers (a job's listener that is slow, or hung), until killed.

Usage (inside a worker's namespace): python3 peer.py ADDRESS PORT...; prints "listening" once
every socket listens, which the test waits for.
"""

from __future__ import annotations

import selectors
import socket
import sys


def main(address: str, ports: list[int]) -> None:
    selector = selectors.DefaultSelector()
    for port in ports:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(64)
        selector.register(listener, selectors.EVENT_READ)
    print("listening", flush=True)
    held = []  # accepted and kept open, never read or written
    while True:
        for key, _ in selector.select():
            assert isinstance(key.fileobj, socket.socket)
            held.append(key.fileobj.accept()[0])


if __name__ == "__main__":
    main(sys.argv[1], [int(p) for p in sys.argv[2:]])
