#!/usr/bin/python3
"""Guest side of ``bench.soak``: reads the tpu-env file over and over while the soak runs (stdlib only).

``soak_reader.py CATALOG FILE OUT``: CATALOG is a JSON list of the documents the soak may
serve, each ``{"label": ..., "values": {name: value}, "good": bool}``: ``good`` if the file may
hold its values, else a document tpuboot must refuse whole, listed only so that a read can be
named after it. Every ``--interval`` seconds the reader reads FILE and files the read as one of:

* ``missing``: the name did not exist (a reader between an unlink and a rename would see this);
* ``garbled``: not UTF-8, or not a whole ``NAME="value"`` file the way a POSIX shell reads it
  (a cut-off last line, an unescaped ``$``, backtick or quote);
* ``unexpected``: a whole file whose values are no good entry's (a mix of two, a stale field, a
  refused document's); each run of such reads of the same values is a *streak*, reported with
  its time, length and the CATALOG entry nearest to it (fewest names whose values differ), so a
  failure explains itself;
* the index of the good CATALOG entry it holds.

Its own parser, not tpuboot's: inside double quotes a backslash escapes only ``$``, a backtick,
``"``, ``\\`` and a newline (removed), as POSIX sh says. The counts, the first few missing and
garbled reads and the first streaks are written to OUT (atomically, every 2 s and at SIGTERM),
with the CLOCK_MONOTONIC its clock started at (``clock_started``: the soak places a streak before
or after each document it served by the same clock).
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
MAX_STREAKS = 20
MAX_DIFFERS = 8  # names listed per streak


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


def differs(values: dict[str, str], other: dict[str, str]) -> list[str]:
    """The names whose values differ between two files (one side missing counts)."""
    return sorted(name for name in values.keys() | other.keys() if values.get(name) != other.get(name))


def nearest(catalog: list[dict[str, Any]], values: dict[str, str]) -> dict[str, Any]:
    """The catalog entry with the fewest differing names (the first of equals), and those names."""
    best = min(catalog, key=lambda entry: len(differs(values, entry["values"])))
    names = differs(values, best["values"])
    shown = [
        f"{n}={values.get(n)!r:.40} (it gives {best['values'].get(n)!r:.40})" for n in names[:MAX_DIFFERS]
    ]
    return {"closest": best["label"], "closest_good": best["good"], "differs": len(names), "names": shown}


class Tally:
    def __init__(self, catalog: list[dict[str, Any]]) -> None:
        self.catalog = catalog
        self.good = [index for index, entry in enumerate(catalog) if entry["good"]]
        self.counts: dict[str, int] = {"reads": 0, "missing": 0, "garbled": 0, "unexpected": 0}
        self.seen: dict[int, int] = {}
        self.samples: list[dict[str, Any]] = []
        self.streaks: list[dict[str, Any]] = []  # runs of unexpected reads of the same values
        self.streak_values: dict[str, str] | None = None  # those of the run going on, if any
        self.streak: dict[str, Any] | None = None  # its entry in streaks (None: past MAX_STREAKS)
        self.started = time.monotonic()

    def at(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def problem(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append({"kind": kind, "at_s": self.at(), "detail": detail})

    def read(self, path: str) -> None:
        self.counts["reads"] += 1
        values = self.values(path)
        index = None if values is None else self.match(values)
        if index is not None:
            self.seen[index] = self.seen.get(index, 0) + 1
        elif values is not None:
            self.unexpected(values)
            return
        self.streak_values = self.streak = None

    def match(self, values: dict[str, str]) -> int | None:
        """The index of the good entry the values are, if any."""
        return next((index for index in self.good if self.catalog[index]["values"] == values), None)

    def values(self, path: str) -> dict[str, str] | None:
        """The file's values; None (counted) if it is missing or garbled."""
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            self.problem("missing", path)
            return None
        try:
            values = parse(data.decode("utf-8"))
        except UnicodeDecodeError:
            values = None
        if values is None:
            self.problem("garbled", repr(data[-200:]))
        return values

    def unexpected(self, values: dict[str, str]) -> None:
        self.counts["unexpected"] += 1
        if values == self.streak_values:
            if self.streak is not None:
                self.streak["reads"] += 1
                self.streak["last_at_s"] = self.at()
            return
        self.streak_values, self.streak = values, None
        if len(self.streaks) < MAX_STREAKS:
            at = self.at()
            self.streak = {"first_at_s": at, "last_at_s": at, "reads": 1, **nearest(self.catalog, values)}
            self.streaks.append(self.streak)

    def write(self, out: str) -> None:
        payload = {**self.counts, "seen": self.seen, "samples": self.samples, "streaks": self.streaks,
                   "seconds": round(time.monotonic() - self.started, 1),
                   "clock_started": self.started}  # fmt: skip
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
