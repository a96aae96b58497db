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


class JournalOnFirstUse(logging.Handler):
    """systemd's JournalHandler, imported at the first record rather than at start.

    `tpuboot run` starts binding before anything is logged; importing systemd.journal first
    would put a tenth of a second (on an emulated CPU) in front of every boot's binds.
    """

    def __init__(self) -> None:
        super().__init__()
        self.journal: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.journal is None:  # handle() holds this handler's lock: one import, one handler
            from systemd.journal import JournalHandler

            self.journal = JournalHandler(SYSLOG_IDENTIFIER=IDENTIFIER)
        self.journal.emit(record)


def setup(verbose: bool = False) -> None:
    """Route the ``tpuboot`` logger to the journal when there is one, else to stderr."""
    logger = logging.getLogger(IDENTIFIER)
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler: logging.Handler
    if under_journal():
        handler = JournalOnFirstUse()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tpuboot: %(message)s"))
    logger.addHandler(handler)
