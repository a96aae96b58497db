"""Is this VM a GKE node? GKE runs vBar and the telemetry collector itself; tpuboot must not.

``gke: auto`` asks the metadata server for the instance attributes GKE sets on its nodes
(``cluster-name``, ``kube-env``): either present means GKE. ``true``/``false`` decide without asking.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from tpuboot.errors import MetadataError

log = logging.getLogger("tpuboot.containers.gke")

GKE_ATTRIBUTES = ("cluster-name", "kube-env")


class Metadata(Protocol):
    def get(self, path: str, *, deadline_s: float) -> object: ...


def gke_attribute(is_set: Callable[[str], bool]) -> str | None:
    """The first GKE instance attribute ``is_set(path)`` finds, None on a VM that is no GKE node.

    ``is_set`` raises :class:`MetadataError` when the server does not answer: not knowing is not
    an answer (the daemon asks again; `tpuboot doctor` says it cannot tell).
    """
    return next((name for name in GKE_ATTRIBUTES if is_set(f"instance/attributes/{name}")), None)


def gke_node(
    mode: str, client: Metadata | None, stop: threading.Event, deadline_s: float = 60.0
) -> bool | None:
    """True on a GKE node, False elsewhere, None if ``stop`` was set before metadata answered.

    With ``auto`` the question is asked until answered: starting vBar on a GKE node because
    the metadata server was slow would run two agents.
    """
    if mode in ("true", "false"):
        return mode == "true"
    if client is None:
        return False
    from tpuboot.env.metadata import MetadataAbsent

    def is_set(path: str) -> bool:
        try:
            client.get(path, deadline_s=deadline_s)
        except MetadataAbsent:
            return False
        return True

    reported = False
    while not stop.is_set():
        try:
            name = gke_attribute(is_set)
            if name is not None:
                log.info("GKE node: instance attribute %s is set", name)
            return name is not None
        except MetadataError as exc:
            if not reported:
                log.warning("GKE check: %s; asking again", exc)
                reported = True
            stop.wait(5.0)
    return None
