"""Registry credentials from the VM's service account, for the pulls of vBar and the collector.

The documented procedure runs ``gcloud auth configure-docker``, which makes docker ask a
credential helper for Google's registries; the helper hands over the VM's service-account
access token from the metadata server as the password of user ``oauth2accesstoken``. tpuboot
pulls through the engine's API, where no helper is asked: it sends the same pair itself with the
pull (:class:`tpuboot.containers.engine.RegistryAuth`; Docker's client puts it in the pull's
``X-Registry-Auth`` header).

- Only to the registries of ``registry_auth.token_registries`` (default: gcr.io, its regional
  hosts ``*.gcr.io``, and Artifact Registry's ``*-docker.pkg.dev``). The registry is the one
  dockerd will contact, parsed by :mod:`tpuboot.references`' grammar and compared as
  written: an entry is a ``host[:port]``, or ``*`` standing for the start of the first label
  (one label, letters, digits and ``-``: ``*.gcr.io`` takes ``us.gcr.io``, never
  ``a.b.gcr.io``, ``gcr.io.evil.example`` or ``us.gcr.io:444``). An image named by tpu-env
  must come through the allowlists too (``vbar.registries``); this list decides only which of
  those get the token, so a metadata-chosen image never carries it to another host.
- The token is read from ``instance/service-accounts/default/token`` with the metadata client
  and kept in memory until :data:`EARLY_EXPIRY` before its ``expires_in`` (the metadata server
  hands out a new one 4 minutes before expiry at the earliest; Google's Go client refreshes
  3 min 45 s early for that reason), or until a registry refuses it. It is never logged, never
  written to disk, and no message quotes what the server sent.
- No token (no service account, metadata server silent, a malformed answer): the pull goes
  without credentials, a public image still comes, and one log line says why (again only when
  the reason changes). A refused pull's message then says what to fix.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from tpuboot.containers.engine import RegistryAuth
from tpuboot.errors import TpubootError
from tpuboot.gce.keys import SERVICE_ACCOUNT_TOKEN
from tpuboot.references import InvalidReference, parse_host_pattern, parse_image

log = logging.getLogger("tpuboot.containers.credentials")

#: The user name Google's registries take with an OAuth access token as the password.
TOKEN_USERNAME = "oauth2accesstoken"
#: A token is used until this many seconds before it expires, then asked for again.
EARLY_EXPIRY = 225.0
#: How long one pull waits for the metadata server's token before going without it.
TOKEN_DEADLINE = 10.0
#: An access token is a few hundred bytes; a longer "token" is not one.
MAX_TOKEN = 8192

# What ``*`` stands for: the start of one DNS label, as a host name spells it.
_LABEL_START = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?")
# A token goes into JSON and an HTTP Authorization header: printable ASCII without spaces.
_TOKEN = re.compile(r"[\x21-\x7e]+")
_REFUSAL = re.compile(r"unauthori[sz]ed|denied|forbidden|authentication required|\b40[13]\b", re.IGNORECASE)


class TokenRegistries:
    """The registries that get the service-account token (``registry_auth.token_registries``)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(parse_host_pattern(entry) for entry in entries)

    def matches(self, registry: str) -> bool:
        """Whether ``registry`` (an ImageRef's host[:port], as written) is one of them."""
        for wildcard, value in self.entries:
            if not wildcard:
                if registry == value:
                    return True
            elif registry.endswith(value) and _LABEL_START.fullmatch(registry[: -len(value)]):
                return True
        return False


class TokenUnavailable(TpubootError):
    """No usable token now; the message says why in one line (never quoting the answer)."""


def parse_token(body: bytes) -> tuple[str, float]:
    """(access token, seconds it stays valid) from the metadata server's JSON answer."""
    try:
        data = json.loads(body)
    except ValueError:
        raise TokenUnavailable(f"the answer at {SERVICE_ACCOUNT_TOKEN} is not JSON") from None
    if not isinstance(data, dict):
        raise TokenUnavailable(f"the answer at {SERVICE_ACCOUNT_TOKEN} is not a JSON object")
    token = data.get("access_token")
    if not isinstance(token, str) or not token:
        raise TokenUnavailable(f"the answer at {SERVICE_ACCOUNT_TOKEN} has no access_token")
    if len(token) > MAX_TOKEN or not _TOKEN.fullmatch(token):
        raise TokenUnavailable(
            f"the access_token at {SERVICE_ACCOUNT_TOKEN} is not a token (blanks, or too long)"
        )
    kind = data.get("token_type", "Bearer")
    if not isinstance(kind, str) or kind.lower() != "bearer":
        raise TokenUnavailable(f"the token at {SERVICE_ACCOUNT_TOKEN} is not a Bearer token")
    expires = data.get("expires_in", 0)
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not 0 <= expires < 1e9:
        raise TokenUnavailable(f"the answer at {SERVICE_ACCOUNT_TOKEN} has an expires_in that is not seconds")
    return token, float(expires)


@dataclass(frozen=True)
class PullCredentials:
    """What one pull sends: ``auth``, or None with ``missing`` saying why a token registry got none."""

    auth: RegistryAuth | None = None
    missing: str = ""

    def advice(self, failure: str) -> str:
        """What to add to a failed pull's message (``failure``: dockerd's reason), or ""."""
        if self.auth is not None and _REFUSAL.search(failure):
            return (
                "; the registry refused the VM's service-account token: grant the service account "
                "read access (roles/artifactregistry.reader) and give the VM a scope that allows it "
                "(--scopes=cloud-platform)"
            )
        if self.missing:
            return f"; pulled without credentials ({self.missing})"
        return ""


ANONYMOUS = PullCredentials()


class Reply(Protocol):
    @property
    def body(self) -> bytes: ...


class TokenSource(Protocol):
    """The metadata client's ``get`` (tpuboot.gce.client.MetadataClient)."""

    def get(self, path: str, *, deadline_s: float) -> Reply: ...


class ServiceAccountCredentials:
    """The VM's service-account token for the pulls from ``registries``; thread-safe (vBar and
    the collector pull from their own threads and share one token)."""

    def __init__(
        self,
        metadata: TokenSource,
        registries: Iterable[str],
        *,
        deadline_s: float = TOKEN_DEADLINE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metadata = metadata
        self.registries = TokenRegistries(registries)
        self.deadline_s = deadline_s
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._valid_until = 0.0
        self._said: str | None = None  # the last reason logged for pulling without a token

    def for_image(self, image: str) -> PullCredentials:
        """The credentials a pull of ``image`` sends: the token if its registry is listed."""
        try:
            registry = parse_image(image).registry
        except InvalidReference:
            return ANONYMOUS  # the allowlist refuses it before any pull
        if not self.registries.matches(registry):
            return ANONYMOUS
        try:
            token = self._current()
        except TokenUnavailable as exc:
            why = str(exc)
            if self._changed(why):
                log.warning(
                    "no service-account token for %s (%s); pulling %s without credentials",
                    registry, why, image, extra={"IMAGE": image},
                )  # fmt: skip
            return PullCredentials(None, f"no service-account token: {why}")
        if self._changed(None):
            log.info("service-account token available again for pulls from %s", registry)
        return PullCredentials(RegistryAuth(TOKEN_USERNAME, token, registry))

    def _changed(self, why: str | None) -> bool:
        """Record why pulls go without a token (None: they have one); True if that changed."""
        with self._lock:
            changed, self._said = why != self._said, why
            return changed

    def forget(self, refused: RegistryAuth) -> None:
        """A registry refused ``refused``: the next pull asks the metadata server again."""
        with self._lock:
            if self._token == refused.password:
                self._token = None

    def _current(self) -> str:
        with self._lock:
            now = self._clock()
            if self._token is not None and now < self._valid_until:
                return self._token
            self._token = None
            try:
                reply = self.metadata.get(SERVICE_ACCOUNT_TOKEN, deadline_s=self.deadline_s)
            except TpubootError as exc:
                from tpuboot.gce.replies import MetadataAbsent  # loaded already: the client's module

                if isinstance(exc, MetadataAbsent):
                    raise TokenUnavailable(
                        f"the metadata server has no {SERVICE_ACCOUNT_TOKEN}: the VM has no service account"
                    ) from None
                raise TokenUnavailable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
            token, expires_in = parse_token(reply.body)
            if expires_in > EARLY_EXPIRY:  # else used once: the server renews it soon
                self._token, self._valid_until = token, now + expires_in - EARLY_EXPIRY
            return token
