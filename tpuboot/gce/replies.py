"""What the metadata server answers, as the client's callers see it: a value, a change, a refusal."""

from __future__ import annotations

from dataclasses import dataclass

from tpuboot.errors import MetadataError


class MetadataAbsent(MetadataError):
    """The server says the key does not exist (HTTP 404)."""

    transient = False


class MetadataRefused(MetadataError):
    """The server answered something retrying will not fix (redirect, 4xx, oversized body).

    ``status`` is the HTTP status when the server refused (403 for guest attributes disabled).
    """

    transient = False

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class MetadataUnanswered(MetadataError):
    """No usable answer within the deadline (refused, dropped, timed out, 5xx): ``url`` is the
    server's, ``reason`` every kind of failure seen with the tries, ``fix`` what to check. Apart,
    so that doctor can say it once in its own words and name it from the checks that need it."""

    def __init__(self, url: str, reason: str, fix: str) -> None:
        super().__init__(f"metadata server {url}: {reason}; {fix}")
        self.url, self.reason, self.fix = url, reason, fix


class Retryable(Exception):
    """One try failed in a way another try may not (connection, 5xx, timeout, no flavor).

    Internal to this package: the client turns it into a retry or a MetadataError. ``kind`` is
    a short, stable name of the failure (the unit of "log once per kind").
    """

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass(frozen=True)
class Reply:
    """A 200 answer: the raw body and the ETag the server gave (None if it gave none)."""

    body: bytes
    etag: str | None

    @property
    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError:
            raise MetadataRefused("the metadata value is not UTF-8 text; fix the attribute") from None


@dataclass(frozen=True)
class Change:
    """What a watch saw: a new value and its ETag, or ``value`` None when the key vanished."""

    value: bytes | None
    etag: str | None
