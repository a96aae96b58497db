"""The three files tpu-env's values are written to, each in its reader's syntax (tpuboot/env/tpuenv.py).

``env.tpu_env_path`` (the tpu-env file itself), ``env.systemd_env_path`` (systemd's
``EnvironmentFile=``) and ``env.docker_env_path`` (``docker run --env-file``): root's, 0644,
atomically. A value one of the last two cannot carry (a newline for docker, a Unicode
noncharacter for systemd, whose reader would refuse the whole file) is left out of that file
only, named in one warning. A failure to write either is logged and added to the status line;
tpu-env itself still counts.
"""

from __future__ import annotations

import logging
import os

from tpuboot import bootbudget
from tpuboot.atomicfile import FileWriteError, write_file
from tpuboot.config import EnvConfig
from tpuboot.env.tpuenv import render_docker_env_file, render_env_file, render_systemd_env_file
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.env.writers")

TPU_ENV_MODE = 0o644  # the runtime user must read it; only root writes it


def write_tpu_env(root: Root, env: EnvConfig, values: dict[str, str]) -> tuple[bool, str]:
    """Write tpu-env (FileWriteError if that fails), then the systemd and docker files; whether
    tpu-env was rewritten, and what to add to the status line (empty: all written)."""
    data = render_env_file(values).encode("utf-8")
    owner = (os.geteuid(), os.getegid())
    written = write_file(root, env.tpu_env_path, data, mode=TPU_ENV_MODE, owner=owner)
    bootbudget.mark(bootbudget.TPU_ENV)  # written or already so: either way it holds the values
    failed = [f"{path} not written: {exc}" for path, exc in _write_formats(root, env, values, owner)]
    return written, "".join(f"; {line}" for line in failed)


def _write_formats(
    root: Root, env: EnvConfig, values: dict[str, str], owner: tuple[int, int]
) -> list[tuple[str, FileWriteError]]:
    """The systemd and docker files that are configured; the failures, each logged."""
    failures: list[tuple[str, FileWriteError]] = []
    for path, (text, skipped) in (
        (env.systemd_env_path, render_systemd_env_file(values)),
        (env.docker_env_path, render_docker_env_file(values)),
    ):
        if path is None:
            continue
        try:
            rewritten = write_file(root, path, text.encode("utf-8"), mode=TPU_ENV_MODE, owner=owner)
        except FileWriteError as exc:
            log.error("tpu-env: %s", exc, extra={"TPU_ENV_PATH": path})
            failures.append((path, exc))
            continue
        if rewritten and skipped:
            log.warning(
                "tpu-env: %s left out of %s: %s",
                ", ".join(skipped),
                path,
                "; ".join(f"{key} {why}" for key, why in skipped.items()),
                extra={"TPU_ENV_PATH": path, "TPU_ENV_SKIPPED": " ".join(skipped)},
            )
    return failures
