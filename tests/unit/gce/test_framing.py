"""Malformed HTTP framing from a server posing as the metadata server: every answer is a value or
one MetadataError line, never another exception (which would escape the watch's handlers).

The server here speaks raw bytes, so each framing error is exactly what is sent.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tpuboot.errors import MetadataError
from tpuboot.gce.client import MetadataClient

HEAD = b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nETag: abc\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, list[bytes]]]:
    """A listening socket that answers every connection with the next of ``answers``, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    answers: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(answers[0] if answers else b"")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener, answers
    stop.set()
    thread.join()
    listener.close()


def fetch(listener: socket.socket) -> bytes:
    """One try: the server answers every try alike, so a retry would only repeat the first one's
    verdict (the client's backoff floor, 0.5 s, does not fit in the 0.5 s deadline)."""
    port = listener.getsockname()[1]
    client = MetadataClient(f"http://127.0.0.1:{port}/computeMetadata/v1/", timeout=1.0)
    try:
        return client.get("instance/attributes/tpu-env", deadline_s=0.5).body
    finally:
        client.close()


@pytest.mark.parametrize(
    "answer",
    [
        CHUNKED + b"-5\r\nhello world\r\n0\r\n\r\n",  # negative size
        CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n",  # not hex
        CHUNKED + "٣\r\nabc\r\n0\r\n\r\n".encode(),  # a digit, but not an ASCII one
        CHUNKED + b"ffffffffffffffffffffffff\r\nabc",  # larger than any body
        CHUNKED + b"5\r\nhel",  # cut inside a chunk
        CHUNKED + b"5\r\nhello\r\n",  # no last chunk
        HEAD + b"Content-Length: -3\r\n\r\nabc",
        HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        HEAD + b"Content-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 2OO OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * 70000 + b"\r\n\r\n",
        b"\x00\xff garbage\r\n\r\n",
    ],
    ids=[
        "negative chunk", "non-hex chunk", "non-ascii digit", "huge chunk", "cut chunk", "no last chunk",
        "negative length", "two lengths", "short body", "bad status", "endless header", "garbage",
    ],
)  # fmt: skip
def test_malformed_framing_is_one_metadata_error(
    server: tuple[socket.socket, list[bytes]], answer: bytes
) -> None:
    listener, answers = server
    answers.append(answer)
    with pytest.raises(MetadataError) as caught:
        fetch(listener)
    assert "\n" not in str(caught.value)
    assert "timed out" not in str(caught.value)  # the framing was judged, not waited out


def test_well_formed_chunks_are_read(server: tuple[socket.socket, list[bytes]]) -> None:
    listener, answers = server
    answers.append(CHUNKED + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    assert fetch(listener) == b"hello world"
