"""Logging: structured journal fields under systemd, one plain line on stderr otherwise.

Callers pass structured fields as ``extra={"DBDF": "0000:00:04.0"}``; upper-case keys
become journal fields (``journalctl DBDF=0000:00:04.0``).
"""

from __future__ import annotations

import logging
import os
import sys

IDENTIFIER = "tpuboot"


def under_journal() -> bool:
    """True when stderr is connected to the journal (systemd sets JOURNAL_STREAM)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    if not stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def setup(verbose: bool = False) -> None:
    """Route the ``tpuboot`` logger to the journal when there is one, else to stderr."""
    logger = logging.getLogger(IDENTIFIER)
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler: logging.Handler
    if under_journal():
        from systemd.journal import JournalHandler

        handler = JournalHandler(SYSLOG_IDENTIFIER=IDENTIFIER)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tpuboot: %(message)s"))
    logger.addHandler(handler)
