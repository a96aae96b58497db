"""The one injectable root under which tpuboot touches every path.

Image builders point it at a chroot and tests at a temporary tree; on a running
host it is ``/``. Code never builds an absolute path itself: it asks a Root.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

ROOT_ENV = "TPUBOOT_ROOT"


class Root:
    """Maps absolute host paths (``/sys/...``) to paths under a prefix."""

    def __init__(self, prefix: str | os.PathLike[str] = "/") -> None:
        self.prefix = Path(prefix).resolve() if str(prefix) != "/" else Path("/")

    @classmethod
    def from_env(cls, override: str | None = None) -> Root:
        """The root given on the command line, else ``$TPUBOOT_ROOT``, else ``/``."""
        return cls(override or os.environ.get(ROOT_ENV) or "/")

    @property
    def is_host(self) -> bool:
        """True when tpuboot acts on the running system itself (not a chroot or test tree)."""
        return self.prefix == Path("/")

    def path(self, absolute: str | PurePosixPath) -> Path:
        """The real location of ``absolute`` (which must start with ``/``) under this root."""
        text = str(absolute)
        if not text.startswith("/"):
            raise ValueError(f"tpuboot paths must be absolute, got {text!r}")
        if self.is_host:
            return Path(text)
        return self.prefix / text.lstrip("/")

    def strip(self, real: Path) -> str:
        """The absolute host path for a real path under this root (for messages)."""
        if self.is_host:
            return str(real)
        return "/" + str(Path(real).relative_to(self.prefix))

    def __repr__(self) -> str:
        return f"Root({str(self.prefix)!r})"
