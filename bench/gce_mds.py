#!/usr/bin/python3
"""The metadata emulator as google-guest-agent needs it: directory long-polls, nested JSON.

The agent's one idle request is a long-poll of the whole tree
(``/computeMetadata/v1//?recursive=true&alt=json&wait_for_change=true&timeout_sec=60&last_etag=E``).
tests/mds_emulator.py answers a directory at once and lists it flat, which would make the agent
spin; the real server waits until something under the directory changes (or the timeout), and
answers a recursive directory as nested JSON. This subclass does both; leaf paths are
unchanged. Runs in the guest beside the tests' emulator module (stdlib + PyYAML)::

    python3 gce_mds.py --bind 169.254.169.254 --port 80 --attributes attrs.yaml --instance inst.yaml
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from typing import Any

sys.path.insert(0, "/usr/local/libexec/tpuboot-test")
import mds_emulator
from mds_emulator import MetadataEmulator, etag_of


def nested(values: dict[str, str], path: str) -> dict[str, Any]:
    """``{"instance/attributes/k": v}`` under ``path`` as the real server's nested JSON object."""
    tree: dict[str, Any] = {}
    for key, value in sorted(values.items()):
        if not key.startswith(path):
            continue
        node = tree
        *parents, leaf = key[len(path) :].split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


class LoggingHandler(mds_emulator._Handler):
    """Each request on stderr (the unit's journal): what the agent asks for, and the answer."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        sys.stderr.write(f"{self.command} {self.path} -> {code}\n")
        sys.stderr.flush()


class GceEmulator(MetadataEmulator):
    def start(self) -> GceEmulator:
        self._stopping.clear()
        self._server = mds_emulator._Server((self.bind, self.port), LoggingHandler, self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="mds-emulator", daemon=True
        )
        self._thread.start()
        return self

    def _directory(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str | None, str]:
        if query.get("recursive", [""])[0] != "true":
            return self._listing(path, query)
        tree = nested(self.values, path)
        if not tree:
            return self._listing(path, query)
        body = json.dumps(tree)
        return 200, body, etag_of(body), "application/json"

    def _lookup(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str | None, str]:
        path = re.sub("/+", "/", path).lstrip("/")  # the agent asks for ".../v1//": the root
        if not (path == "" or path.endswith("/")):
            return super()._lookup(path, query)
        if query.get("wait_for_change", [""])[0] == "true":
            try:
                timeout = min(float(query.get("timeout_sec", ["300"])[0]), 3600.0)
            except ValueError:
                timeout = 300.0
            last = query.get("last_etag", [None])[0]
            with self._changed:
                version = self._version
                current = self._directory(path, query)[2]
                if last is None or last == current:  # else the caller is behind: answer at once
                    self._changed.wait_for(
                        lambda: self._stopping.is_set() or self._version != version, timeout=timeout
                    )
        with self._changed:
            return self._directory(path, query)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--bind", default="169.254.169.254")
    parser.add_argument("--port", type=int, default=80)
    parser.add_argument("--attributes")
    parser.add_argument("--instance")
    args = parser.parse_args(argv)
    emulator = GceEmulator(
        mds_emulator._load_values(args.attributes),
        instance=mds_emulator._load_values(args.instance),
        bind=args.bind,
        port=args.port,
    )
    mds_emulator.serve_until_signalled(emulator, "GCE metadata emulator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
