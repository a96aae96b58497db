"""The journal fields tpuboot's log records become, through the real python-systemd JournalHandler
(234 on Ubuntu 22.04, 235 elsewhere): the contract tpuboot.logs relies on, that an upper-case
``extra`` key is a journal field (``journalctl DBDF=0000:00:04.0``).
"""

from __future__ import annotations

import logging
from typing import Any

from systemd.journal import JournalHandler

from tpuboot.logs import IDENTIFIER


def test_extra_upper_case_keys_become_journal_fields() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def send(message: str, /, **fields: Any) -> None:  # journal.send's place; fields include "message"
        sent.append((message, fields))

    handler = JournalHandler(sender_function=send, SYSLOG_IDENTIFIER=IDENTIFIER)
    log = logging.getLogger("tpuboot.test.journal")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning("bind failed: %s", "busy", extra={"DBDF": "0000:00:04.0"})
    finally:
        log.removeHandler(handler)
    [(message, fields)] = sent
    assert message == "bind failed: busy"
    assert fields["SYSLOG_IDENTIFIER"] == IDENTIFIER
    assert fields["DBDF"] == "0000:00:04.0"
    assert fields["PRIORITY"] == "4"  # warning
