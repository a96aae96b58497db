"""Logging set-up: the journal handler is imported only when the first record is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, sys
from tpuboot.logs import JournalOnFirstUse
handler = JournalOnFirstUse()
log = logging.getLogger("tpuboot.test")
log.addHandler(handler)
log.propagate = False
print("systemd.journal" in sys.modules)
sent = []
import systemd.journal
def emit(self, record):
    sent.append((record.getMessage(), getattr(record, "DBDF", None)))
systemd.journal.JournalHandler.emit = emit
log.warning("bind failed: %s", "boom", extra={"DBDF": "0000:00:04.0"})
log.warning("again")  # one handler, made once
print(sent[0], type(handler.journal).__name__, len(sent))
"""


def test_journal_handler_is_imported_at_the_first_record_not_at_start():
    here = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=here)
    assert done.stdout.splitlines() == ["False", "('bind failed: boom', '0000:00:04.0') JournalHandler 2"]
