"""The one injectable root under which tpuboot touches every path.

Image builders point it at a chroot and tests at a temporary tree; on a running
host it is ``/``. Code never builds an absolute path itself: it asks a Root.

Under a root that is not ``/``, every path resolves as it would inside a chroot there: an
absolute symbolic link starts again at the root, ``..`` stops at it, and no link leads out.
An image tree is someone else's files: its ``run -> /etc`` or ``tpuboot.yaml -> /etc/shadow``
must mean the image's /etc, never the build host's. :meth:`Root.path` resolves the links itself,
one component at a time (at most :data:`MAX_SYMLINK_HOPS`), so the path it returns has none left
at the moment it is built; what must also hold against a tree that changes meanwhile (writes,
reads of files a user may own, removals) goes through :mod:`tpuboot.atomicfile`, which walks the
same way with directory descriptors and ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from pathlib import Path, PurePosixPath

from tpuboot.errors import LinkLoop, UsageError, loop_fix

ROOT_ENV = "TPUBOOT_ROOT"
#: Links followed while resolving one path, as the kernel's own limit (MAXSYMLINKS, 40).
MAX_SYMLINK_HOPS = 40
#: The most a configuration file or a /proc or sysfs entry is read to: anything bigger is not one.
MAX_FILE_BYTES = 1 << 20


class RootError(UsageError):
    """The root itself is unusable (empty, missing, not a directory, a symlink loop)."""


class LinkLoopError(LinkLoop, OSError):
    """A path under the root goes through more links than :data:`MAX_SYMLINK_HOPS`: an OSError
    with ELOOP, as the kernel's own, so every handler of a failed open handles it too."""

    def __init__(self, problem: str, link: str) -> None:
        self.problem, self.link = problem, link
        OSError.__init__(self, errno.ELOOP, f"{problem}; {loop_fix(self)}")

    def __str__(self) -> str:
        return str(self.strerror)


def split(path: str) -> list[str]:
    """The components of ``path``, without empty ones and ``.``."""
    return [part for part in path.split("/") if part not in ("", ".")]


class Root:
    """Maps absolute paths (``/sys/...``) to real paths under a prefix, as a chroot there would."""

    def __init__(self, prefix: str | os.PathLike[str] = "/") -> None:
        text = os.fspath(prefix)
        if text == "":
            raise RootError("the root is empty; give a directory, or no --root for this host (/)")
        if text == "/":
            self.prefix = Path("/")
            return
        try:
            self.prefix = Path(text).resolve()
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on Python 3.10 to 3.12
            raise RootError(f"root {text}: a symbolic link loop; give the image's directory") from None

    @classmethod
    def from_env(cls, override: str | None = None) -> Root:
        """The root given on the command line, else ``$TPUBOOT_ROOT``, else ``/``. Given but empty
        is an error, never the host: a script's unset variable must not turn a chroot into ``/``."""
        if override is not None:
            text, where = override, "--root"
        else:
            text, where = os.environ.get(ROOT_ENV, "/"), f"${ROOT_ENV}"
        if text == "":
            raise RootError(
                f"{where} is empty; give the image's directory, or leave it out for this host (/)"
            )
        root = cls(text)
        if not root.prefix.is_dir():
            what = "does not exist" if not os.path.lexists(root.prefix) else "is not a directory"
            raise RootError(f"{where} {text} {what}; give the image's directory")
        return root

    @property
    def is_host(self) -> bool:
        """True when tpuboot acts on the running system itself (not a chroot or test tree)."""
        return self.prefix == Path("/")

    def path(self, absolute: str | PurePosixPath, *, follow: bool = True) -> Path:
        """The real location of ``absolute`` (which must start with ``/``) under this root.

        Every link on the way is resolved inside the root; ``follow=False`` leaves the last
        component as it is (to lstat, readlink or remove a link itself). Raises
        :class:`LinkLoopError` on a loop. On the host, the path as given (the kernel resolves it).
        """
        text = str(absolute)
        if not text.startswith("/"):
            raise ValueError(f"tpuboot paths must be absolute, got {text!r}")
        if self.is_host:
            return Path(text)
        resolved, escapes = self._resolve(text, follow)
        # Where no link leads out, the kernel resolves the path as given to the same file: keep it
        # as given (what a fake sysfs records, what a message shows).
        return self.prefix.joinpath(*resolved) if escapes else self.prefix / text.lstrip("/")

    def _resolve(self, text: str, follow: bool) -> tuple[list[str], bool]:
        """The components under the prefix, none a link; and whether a link led out (absolute,
        or a ``..`` past the root), where the kernel would leave the root."""
        queue = deque(split(text))
        done: list[str] = []
        hops = 0
        escapes = False
        missing = False  # past a component that does not exist: the rest is only text
        while queue:
            name = queue.popleft()
            if name == "..":
                if done:
                    done.pop()
                else:
                    escapes = True  # the kernel would go above the root
                continue
            if missing or (not queue and not follow):
                done.append(name)
                continue
            try:
                target = os.readlink(self.prefix.joinpath(*done, name))
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    missing = True
                elif exc.errno != errno.EINVAL:  # EINVAL: there, and not a link
                    raise
                done.append(name)
                continue
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                link = "/" + "/".join([*done, name])
                raise LinkLoopError(
                    f"{text} under {self.prefix}: more than {MAX_SYMLINK_HOPS} symbolic links, a loop "
                    f"through {link}",
                    link,
                )
            if target.startswith("/"):
                done, escapes = [], True
            queue.extendleft(reversed(split(target)))
        return done, escapes

    def resolve(self, absolute: str) -> str:
        """``absolute`` with every link on it resolved under this root (the file it names, to tell
        two names of one file apart: ``/lib/x`` and ``/usr/lib/x`` on a merged /usr)."""
        if self.is_host:
            return os.path.realpath(absolute)
        return "/" + "/".join(self._resolve(absolute, True)[0])

    def links_on(self, absolute: str) -> str | None:
        """The first component of ``absolute`` that is a symbolic link under this root (the path
        as given, up to it), or None: for what tpuboot does only where no link leads."""
        done = ""
        for name in split(absolute):
            done += "/" + name
            if (self.prefix / done.lstrip("/")).is_symlink():
                return done
        return None

    def strip(self, real: Path) -> str:
        """The absolute host path for a real path under this root (for messages)."""
        if self.is_host:
            return str(real)
        return "/" + str(Path(real).relative_to(self.prefix))

    def __repr__(self) -> str:
        return f"Root({str(self.prefix)!r})"
