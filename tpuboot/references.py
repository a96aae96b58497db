"""The grammar of registry hosts and image references: which registry an image comes from, and
whether tpuboot may run it privileged.

Imported by the configuration's validators and by the containers alike, so it imports nothing of
tpuboot's but :mod:`tpuboot.errors` (which imports nothing): loading a config that names an image
or a token registry pulls in no container engine.

The vBar and telemetry containers run privileged on the host network: whoever controls their
image controls the VM. tpuboot runs an image only if its registry is in the configured
allowlist (``vbar.registries``, ``telemetry.registries``), a defence that holds even if the
image name itself is set by someone it should not be (tpu-env comes from instance metadata).

An image reference is parsed with the grammar dockerd uses (the ``distribution/reference``
package), written out here so that tpuboot and dockerd agree on the registry: the first
``/``-separated component is a registry only if it contains ``.`` or ``:``, is ``localhost``,
or has an upper-case letter; otherwise the image is on Docker Hub (``docker.io``). A reference
dockerd could read differently from this grammar (a trailing dot, ``@`` in the host, non-ASCII
letters, a scheme) is refused as not valid rather than guessed at. Registries are compared as
written, host and port, with no case folding or DNS: ``GCR.IO`` and ``gcr.io:443`` are not
``gcr.io``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from tpuboot.errors import TpubootError, shown

DOCKER_HUB = "docker.io"
#: Other spellings of Docker Hub that dockerd maps to it.
_HUB_ALIASES = ("index.docker.io",)
#: dockerd refuses longer names (distribution's NameTotalLengthMax).
NAME_MAX = 255

# distribution/reference's grammar, ASCII only (Python's \w would take any letter).
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_PATH = rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE = re.compile(rf"(?P<name>(?:{_DOMAIN}/)?{_PATH})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
_DOMAIN_RE = re.compile(_DOMAIN)
_PATH_RE = re.compile(_PATH)


class InvalidReference(TpubootError, ValueError):
    """Not an image reference dockerd would read as tpuboot does (a ValueError too: a validator's
    ``except ValueError`` takes it as any other malformed value)."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``registry`` (host[:port], docker.io for Docker Hub) and ``path``."""

    text: str
    registry: str
    path: str
    tag: str | None
    digest: str | None


def _split_registry(name: str) -> tuple[str, str]:
    """dockerd's rule: the first component is a registry only if it cannot be a repository name."""
    first, slash, rest = name.partition("/")
    if not slash or (not any(c in first for c in ".:") and first != "localhost" and first.lower() == first):
        return DOCKER_HUB, name
    return first, rest


def parse_image(text: str) -> ImageRef:
    """Parse an image reference; raises InvalidReference if dockerd's grammar does not accept it."""
    match = _REFERENCE.fullmatch(text) if text.isascii() else None
    if match is None or len(match["name"]) > NAME_MAX:
        raise InvalidReference(text)
    registry, path = _split_registry(match["name"])
    # The grammar can read "a_b.c/x" as a path alone while the split takes a_b.c as a host.
    if not _DOMAIN_RE.fullmatch(registry) or not _PATH_RE.fullmatch(path):
        raise InvalidReference(text)
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in path:
        path = "library/" + path  # an official image: docker.io/library/NAME
    return ImageRef(text, registry, path, match["tag"], match["digest"])


def parse_entry(text: str) -> tuple[str, str | None]:
    """An allowlist entry, ``host[:port]`` or ``host[:port]/path/prefix``: (registry, prefix or None).

    Raises ValueError with the fix: an entry that could never match is a mistake.
    """
    registry, slash, prefix = text.partition("/")
    if not _DOMAIN_RE.fullmatch(registry) or registry != registry.lower():
        raise ValueError(f"{text!r} is not a registry host[:port] in lowercase, like gcr.io")
    if registry in _HUB_ALIASES:
        raise ValueError(f"{text!r}: write Docker Hub as docker.io")
    if slash and not _PATH_RE.fullmatch(prefix):
        raise ValueError(f"{text!r}: the path after the host must be a repository path, like gcr.io/project")
    return registry, prefix if slash else None


def parse_host_pattern(text: str) -> tuple[bool, str]:
    """A ``registry_auth.token_registries`` entry as (wildcard, host or suffix).

    Raises ValueError with the fix: an entry that could match more than meant is refused.
    """
    wildcard = text.startswith("*")
    rest = text[1:] if wildcard else text
    sample = "x" + rest if wildcard else text
    if "*" in rest:
        raise ValueError(f"{text!r}: '*' may only start the entry, like *.gcr.io")
    registry, prefix = parse_entry(sample)  # ValueError: not a lowercase host[:port]
    if prefix is not None:
        raise ValueError(f"{text!r}: give the registry host alone, without a path")
    if wildcard and (rest[:1] not in (".", "-") or registry.split(":")[0].count(".") < 2):
        raise ValueError(
            f"{text!r}: '*' must stand for the start of the first label of a host under a domain "
            "of two labels or more, like *.gcr.io or *-docker.pkg.dev"
        )
    return wildcard, rest if wildcard else registry


class ImageRefused(TpubootError):
    """The image may not be run privileged; the message is one line with the fix."""


class RegistryAllowlist:
    """The registries (and optional path prefixes) a privileged container's image may come from.

    ``key`` names the configuration key in messages (``vbar.registries``).
    """

    def __init__(self, entries: Iterable[str], key: str) -> None:
        self.entries = tuple(parse_entry(entry) for entry in entries)
        self.key = key

    def allows(self, ref: ImageRef) -> bool:
        for registry, prefix in self.entries:
            if registry != ref.registry:
                continue
            if prefix is None or ref.path == prefix or ref.path.startswith(prefix + "/"):
                return True
        return False

    def check(self, image: str, origin: str = "") -> ImageRef:
        """The parsed image if allowed; else ImageRefused saying why and what to change."""
        try:
            ref = parse_image(image)
        except InvalidReference:
            where = f"; fix {origin}" if origin else ""
            quoted = shown(image, 120)
            raise ImageRefused(f"image {quoted} refused: not a valid image reference{where}") from None
        if self.allows(ref):
            return ref
        if any(registry == ref.registry for registry, _ in self.entries):
            what = f"repository {ref.registry}/{ref.path}"  # its host is listed, with other paths
        else:
            what = f"registry {ref.registry}"
        raise ImageRefused(
            f"image {ref.text} refused: {what} not in {self.key}; add it there if you trust it"
        )
