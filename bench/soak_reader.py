#!/usr/bin/python3
"""Guest side of ``bench.soak``: reads the tpu-env file over and over while the soak runs (stdlib only).

``soak_reader.py CATALOG FILE OUT``: CATALOG is a JSON list of the value sets the file may
hold (each a name -> value object). Every ``--interval`` seconds the reader reads FILE and
files the read as one of:

* ``missing``: the name did not exist (a reader between an unlink and a rename would see this);
* ``garbled``: not UTF-8, or not a whole ``NAME="value"`` file the way a POSIX shell reads it
  (a cut-off last line, an unescaped ``$``, backtick or quote);
* ``unexpected``: a whole file whose values are none of CATALOG's (a mix of two, a stale field);
* the index of the CATALOG entry it holds.

Its own parser, not tpuboot's: inside double quotes a backslash escapes only ``$``, a backtick,
``"``, ``\\`` and a newline (removed), as POSIX sh says. The counts and the first few problems
are written to OUT (atomically, every 2 s and at SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

ESCAPABLE = '$`"\\\n'
NAME_START = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_"
NAME_REST = NAME_START + "0123456789"
MAX_SAMPLES = 5


def parse(text: str) -> dict[str, str] | None:
    """``NAME="value"`` lines as sh reads them; None if the text is anything else."""
    values: dict[str, str] = {}
    pos, end = 0, len(text)
    while pos < end:
        start = pos
        if text[pos] not in NAME_START:
            return None
        while pos < end and text[pos] in NAME_REST:
            pos += 1
        name = text[start:pos]
        if text[pos : pos + 2] != '="':
            return None
        pos += 2
        value: list[str] = []
        while True:
            if pos >= end:
                return None  # the closing quote never came: a cut-off file
            char = text[pos]
            if char == '"':
                break
            if char in "$`":
                return None  # would expand
            if char == "\\" and pos + 1 < end and text[pos + 1] in ESCAPABLE:
                if text[pos + 1] != "\n":
                    value.append(text[pos + 1])
                pos += 2
                continue
            value.append(char)
            pos += 1
        if text[pos + 1 : pos + 2] != "\n":
            return None
        values[name] = "".join(value)
        pos += 2
    return values


class Tally:
    def __init__(self, catalog: list[dict[str, str]]) -> None:
        self.catalog = catalog
        self.counts: dict[str, int] = {"reads": 0, "missing": 0, "garbled": 0, "unexpected": 0}
        self.seen: dict[int, int] = {}
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def problem(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.samples) < MAX_SAMPLES:
            at = round(time.monotonic() - self.started, 3)
            self.samples.append({"kind": kind, "at_s": at, "detail": detail})

    def read(self, path: str) -> None:
        self.counts["reads"] += 1
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            self.problem("missing", path)
            return
        try:
            values = parse(data.decode("utf-8"))
        except UnicodeDecodeError:
            values = None
        if values is None:
            self.problem("garbled", repr(data[-200:]))
            return
        for index, entry in enumerate(self.catalog):
            if values == entry:
                self.seen[index] = self.seen.get(index, 0) + 1
                return
        self.problem("unexpected", json.dumps(sorted(values))[:300])

    def write(self, out: str) -> None:
        payload = {**self.counts, "seen": self.seen, "samples": self.samples,
                   "seconds": round(time.monotonic() - self.started, 1)}  # fmt: skip
        temp = f"{out}.tmp"
        with open(temp, "w") as handle:
            json.dump(payload, handle)
        os.replace(temp, out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("catalog")
    parser.add_argument("file")
    parser.add_argument("out")
    parser.add_argument("--interval", type=float, default=0.02)
    args = parser.parse_args()
    with open(args.catalog) as handle:
        tally = Tally(json.load(handle))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    last_write = 0.0
    while not stop:
        tally.read(args.file)
        now = time.monotonic()
        if now - last_write >= 2.0:
            tally.write(args.out)
            last_write = now
        time.sleep(args.interval)
    tally.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
