"""What makes an HTTP answer the metadata server's, and what a failed try was, in words of ours.

- Request and response both carry ``Metadata-Flavor: Google``; a response without it is not from
  the metadata server (a captive portal, a proxy, another service on the port).
- 404 is an answer ("absent"), not a failure; 5xx and 429 may pass; any other status is a refusal
  that retrying will not fix, with the first line of the server's reason.
- The body is streamed and capped (``max_body``); a short body is detected even where urllib3
  1.26 would not check Content-Length.
"""

from __future__ import annotations

import http.client
import time

import requests
import urllib3

from tpuboot.gce.replies import MetadataAbsent, MetadataRefused, Retryable
from tpuboot.numbers import ascii_int

FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
REQUEST_HEADERS = {FLAVOR_HEADER: FLAVOR, "Accept-Encoding": "identity"}


def check_answer(response: requests.Response, deadline: float) -> None:
    """Raise unless ``response`` is a 200 from the metadata server: Retryable, MetadataAbsent or -Refused."""
    flavor = response.headers.get(FLAVOR_HEADER)
    if flavor != FLAVOR:
        raise Retryable(
            f"answer without the {FLAVOR_HEADER}: {FLAVOR} header (not the metadata server?)"
            if flavor is None
            else f"answer with {FLAVOR_HEADER}: {flavor[:40]!r} (not the metadata server?)"
        )
    status = response.status_code
    if status == 404:
        raise MetadataAbsent(f"{response.url.split('?')[0]}: no such metadata key")
    if status >= 500 or status == 429:
        raise Retryable(f"HTTP {status}")
    if status != 200:
        said = _reason(response, deadline)
        raise MetadataRefused(f"answered HTTP {status}{said}; check the key and the request", status)


def _reason(response: requests.Response, deadline: float) -> str:
    """The first line of a refusal's body, printable and short (the real server says why there:
    "Guest attributes endpoint access is disabled."); empty if there is none to read in time."""
    head = b""
    try:
        for chunk in response.iter_content(256):
            head += chunk
            if len(head) >= 256 or time.monotonic() > deadline:
                break
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError,
            http.client.HTTPException):  # fmt: skip
        pass  # a malformed body cannot turn the refusal into a retried failure
    line = head[:256].decode("utf-8", "replace").strip().splitlines()[:1]
    text = "".join(c if c.isprintable() else "?" for c in (line[0] if line else ""))[:120]
    return f" ({text})" if text else ""


def read_body(response: requests.Response, deadline: float, max_body: int) -> bytes:
    """The whole body, at most ``max_body`` bytes (MetadataRefused beyond), read by ``deadline``."""
    header = response.headers.get("Content-Length")
    declared = ascii_int(header)
    if header is not None and declared is None:
        what = f"answer with Content-Length {header[:40]!r}, not a number (not the metadata server?)"
        raise Retryable(what)
    if declared is not None and declared > max_body:
        raise MetadataRefused(_too_big(max_body))
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_content(1 << 16):
        size += len(chunk)
        if size > max_body:
            raise MetadataRefused(_too_big(max_body))
        if time.monotonic() > deadline:  # the socket ends each receive by it; this ends the loop
            raise Retryable("timed out")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoded = response.headers.get("Content-Encoding", "identity") != "identity"
    if declared is not None and not encoded and len(body) != declared:
        raise Retryable("connection dropped")
    return body


def _too_big(max_body: int) -> str:
    return f"metadata value over {max_body} bytes; raise metadata.max_body or shrink the value"


def _malformed(exc: BaseException, depth: int = 0) -> http.client.HTTPException | None:
    """The HTTP parser's complaint behind ``exc`` (urllib3 and requests wrap it as "Connection
    aborted"), or None: a server that hung up (RemoteDisconnected, IncompleteRead) is no complaint."""
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.IncompleteRead)):
        return None
    if isinstance(exc, http.client.HTTPException):
        return exc
    if depth > 4:
        return None
    for inner in (*exc.args, exc.__cause__, exc.__context__):
        if isinstance(inner, BaseException):
            found = _malformed(inner, depth + 1)
            if found is not None:
                return found
    return None


def _malformed_kind(exc: http.client.HTTPException) -> str:
    """What was wrong with the answer, in words of ours: a stable kind, nothing the server chose."""
    if isinstance(exc, http.client.LineTooLong):
        what = "a header line over 64 KiB"
    elif isinstance(exc, http.client.BadStatusLine):
        what = "no valid HTTP status line"
    elif "more than" in str(exc) and "headers" in str(exc):
        what = "more than 100 header lines"
    else:
        what = f"a malformed head ({type(exc).__name__})"
    return f"answer with {what} (not the metadata server?)"


def failure_kind(exc: BaseException) -> str:
    """A short, stable name for why a try failed (the unit of 'log once per kind')."""
    malformed = _malformed(exc)
    if malformed is not None:
        return _malformed_kind(malformed)
    text = str(exc)
    if isinstance(exc, requests.Timeout) or "timed out" in text:
        return "timed out"
    if "Connection refused" in text:
        return "connection refused"
    if "unreachable" in text or "No route to host" in text:
        return "network unreachable"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError) or any(
        word in text
        for word in ("IncompleteRead", "RemoteDisconnected", "aborted", "reset by peer", "Broken pipe")
    ):
        return "connection dropped"
    return f"request failed ({type(exc).__name__})"
