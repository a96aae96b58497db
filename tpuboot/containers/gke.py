"""Is this VM a GKE node? GKE runs vBar and the telemetry collector itself; tpuboot must not.

``gke: auto`` asks the metadata server for the instance attributes GKE sets on its nodes
(``cluster-name``, ``kube-env``): either present, whatever its value, means GKE; both absent (404)
means not. ``true``/``false`` decide without asking. Anything else the server does (no answer, a
refusal) leaves the question open: not knowing is not an answer. :func:`ask_gke` is the one rule;
the daemon asks until it is answered (:func:`gke_node`), `tpuboot doctor` once and says when it
cannot tell.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tpuboot.config import TriState, decided
from tpuboot.errors import MetadataError
from tpuboot.gce.keys import INSTANCE_ATTRIBUTES
from tpuboot.gce.replies import MetadataAbsent

log = logging.getLogger("tpuboot.containers.gke")

GKE_ATTRIBUTES = ("cluster-name", "kube-env")


class Metadata(Protocol):
    def get(self, path: str, *, deadline_s: float) -> object: ...


@dataclass(frozen=True)
class GkeAnswer:
    """Whether this VM is a GKE node (``node`` None: the metadata server did not say), and why."""

    node: bool | None
    why: str


def ask_gke(mode: TriState, metadata: Metadata | None, deadline_s: float) -> GkeAnswer:
    """The answer of the configuration (``true``/``false``) or, for ``auto``, of one look at the
    metadata server, each key within ``deadline_s``; ``metadata`` None: no server to ask."""
    configured = decided(mode)
    if configured is not None:
        return GkeAnswer(configured, f"gke is {mode} in the configuration")
    if metadata is None:
        return GkeAnswer(None, "no metadata server to ask")
    for name in GKE_ATTRIBUTES:
        try:
            metadata.get(INSTANCE_ATTRIBUTES + name, deadline_s=deadline_s)
        except MetadataAbsent:
            continue
        except MetadataError as exc:
            return GkeAnswer(None, f"the metadata server did not answer ({exc})")
        return GkeAnswer(True, f"instance attribute {name} is set")
    return GkeAnswer(False, "no GKE instance attribute")


def gke_node(
    mode: TriState,
    client: Metadata | None,
    stop: threading.Event,
    deadline_s: float = 60.0,
    unanswered: Callable[[str], None] | None = None,
) -> bool | None:
    """True on a GKE node, False elsewhere, None if ``stop`` was set before metadata answered.

    With ``auto`` the question is asked until answered: starting vBar on a GKE node because
    the metadata server was slow would run two agents. ``unanswered(why)`` hears, once, why it
    is still being asked, so that STATUS can say what vBar waits for.
    """
    reported = False
    configured = decided(mode) is not None
    while configured or not stop.is_set():
        answer = ask_gke(mode, client, deadline_s)
        if answer.node is not None:
            if not configured and answer.node:
                log.info("GKE node: %s", answer.why)
            return answer.node
        if not reported:
            log.warning("GKE check: %s; asking again", answer.why)
            if unanswered is not None:
                unanswered(answer.why)
            reported = True
        stop.wait(5.0)
    return None
