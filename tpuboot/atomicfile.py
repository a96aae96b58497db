"""Atomic, symlink-safe file writes: the one way tpuboot writes a configuration-like file.

Why so careful: some targets live in directories an unprivileged user can write
(``/home/tpu-runtime``). A root process that opens ``/home/tpu-runtime/tpu-env`` by name
would follow a symlink the user planted there and overwrite ``/etc/shadow``. So every path
is walked one component at a time from the Root with directory file descriptors
(``O_DIRECTORY | O_NOFOLLOW``, ``dir_fd=``), the new content goes to an ``O_EXCL |
O_NOFOLLOW`` temporary file in the same directory, and ``rename`` (which replaces a
symlink, never writes through it) puts it in place.

Symlink rule: a symlink is followed only when it sits in a directory that only root (or
this process's user) can write, since only they could have put it there; in any other
directory it is refused (intermediate component) or replaced (final component).
Absolute symlink targets are resolved under the Root, as a chroot would.

A directory a user owns (``/home/tpu-runtime`` may be the home of a ``tpu-runtime`` user;
tpuboot.service has CAP_DAC_OVERRIDE to write there): its owner may rename or delete anything
in it at any moment, tpuboot's files included, and no open-by-name can be made safe against
that. What holds: tpuboot opens nothing that is there (the only file it writes is the one it
just created, through that fd), follows no link there, and changes only its own temp name and
the target's name (one rename); the sweep below may unlink what the user put at a stale temp
name. So the user can make tpu-env say anything (it is their directory; nothing privileged
may read it back: tpuboot keeps its own parse), or make a write fail (a directory in the way:
a one-line error, the next change is written), but not make tpuboot write anywhere else or
read anything but names. Directory listings stream, so a huge directory costs time, not memory.

Crash safety: temp file written and fsynced, renamed, directory fsynced; a reader (or a
reboot) sees the old content or the new, never a mix. A crash can leave a temporary
``.NAME.tpuboot-XXXXXXXX`` file beside the target; it is never read, and the next write of NAME
removes it once it is a minute old (a younger one may be another tpuboot's write in flight).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator

from tpuboot.errors import LinkLoop, TpubootError, loop_fix
from tpuboot.paths import MAX_FILE_BYTES, MAX_SYMLINK_HOPS, Root, split

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_TRIES = 8
_TEMP_HEX = 8  # secrets.token_hex(4)
STALE_TEMP_S = 60.0


class FileError(TpubootError):
    """A file under the Root could not be used safely (read, written or removed)."""


class FileWriteError(FileError):
    """A file could not be replaced, created or removed safely."""


class FileReadError(FileError):
    """A file could not be read safely: unreadable, not a regular file, too large, or behind a
    link that is not followed."""


class _Loop(LinkLoop):
    """A path whose links go round, named by a link of the loop."""

    def __init__(self, path: str, link: str) -> None:
        self.problem, self.link = (
            f"{path}: more than {MAX_SYMLINK_HOPS} symbolic links, a loop through {link}",
            link,
        )
        super().__init__(f"{self.problem}; {loop_fix(self)}")


class ReadLoop(FileReadError, _Loop):
    """A read through links that go round."""


class WriteLoop(FileWriteError, _Loop):
    """A write (or a removal) through links that go round."""


#: ``sweep(dir_fd, name)``: remove what crashed writes of ``name`` left in the directory.
Sweep = Callable[[int, str], None]


def write_file(
    root: Root,
    path: str,
    data: bytes,
    *,
    mode: int | None = None,
    owner: tuple[int, int] | None = None,
    dir_mode: int = 0o755,
    sweep: Sweep | None = None,
) -> bool:
    """Atomically make ``path`` (absolute, under ``root``) hold ``data``; True if it was rewritten.

    ``mode``/``owner`` None keep the existing file's (0644 and this process's for a new
    file). A file that already has this content, mode and owner is left untouched, so
    repeated runs cause no writes. Missing directories are created with ``dir_mode``.
    ``sweep`` (default :func:`sweep_stale_temps`) runs once the file is in place; its OSError
    is ignored, since the write is done.
    """
    try:
        parent, name = _resolve(root, path, create=True, dir_mode=dir_mode)
    except OSError as exc:
        fix = (
            ""
            if exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM)
            else "; check the directories on its path"
        )
        raise FileWriteError(f"cannot write {path}: {_why(exc)}{fix}") from None
    try:
        current = _stat_regular(parent, name)
        want_mode = mode if mode is not None else (stat.S_IMODE(current.st_mode) if current else 0o644)
        want_owner = owner if owner is not None else ((current.st_uid, current.st_gid) if current else None)
        if current and _same(parent, name, current, data, want_mode, want_owner):
            return False
        _replace(parent, name, data, want_mode, want_owner, sweep or sweep_stale_temps)
        return True
    except OSError as exc:
        raise FileWriteError(f"cannot write {path}: {_write_fix(exc)}") from None
    finally:
        os.close(parent)


def read_file(root: Root, path: str, *, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """The content of ``path`` (symlink-safe like write_file), or None if it does not exist.

    ``limit`` bounds what is read (a configuration or state file is never bigger than
    :data:`~tpuboot.paths.MAX_FILE_BYTES`): a longer file raises FileReadError.
    """
    try:
        parent, name = _resolve(root, path, create=False, error=FileReadError)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileReadError(f"cannot read {path}: {_why(exc)}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileReadError(f"cannot read {path}: {_why(exc)}") from None
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileReadError(f"cannot read {path}: not a regular file; remove it")
        content = _read_all(fd, limit + 1)
    finally:
        os.close(fd)
    if len(content) > limit:
        raise FileReadError(f"cannot read {path}: larger than {limit} bytes; remove it")
    return content


def open_lock(root: Root, path: str, *, mode: int = 0o600) -> int:
    """An fd of ``path`` to take an flock on, the file created (``mode``) if missing: walked as
    write_file walks, so it is never a file outside the root or one a planted link names."""
    try:
        parent, name = _resolve(root, path, create=True)
    except OSError as exc:
        raise FileWriteError(f"cannot open {path}: {_why(exc)}") from None
    try:
        return os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    except OSError as exc:
        raise FileWriteError(f"cannot open {path}: {_why(exc)}") from None
    finally:
        os.close(parent)


def remove_file(root: Root, path: str) -> bool:
    """Remove ``path`` if it is a file or a link (the link itself, never what it points to); False
    if there is none. Walked as write_file walks: what is removed is what would have been written."""
    try:
        parent, name = _resolve(root, path, create=False, follow_last=False)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise FileWriteError(f"cannot remove {path}: {_why(exc)}") from None
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise FileWriteError(f"{path} is a directory, not the file tpuboot writes: remove it by hand")
        os.unlink(name, dir_fd=parent)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise FileWriteError(f"cannot remove {path}: {_write_fix(exc)}") from None
    finally:
        os.close(parent)


def remove_files_in(root: Root, directory: str) -> list[str]:
    """Remove the files and links directly in ``directory`` (never through a link at
    ``directory`` itself, never a subdirectory); the paths removed, sorted."""
    try:
        parent, name = _resolve(root, directory, create=False, follow_last=False)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise FileWriteError(f"cannot empty {directory}: {_why(exc)}") from None
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):  # none, or not a directory of its own
            return []
        raise FileWriteError(f"cannot empty {directory}: {_why(exc)}") from None
    finally:
        os.close(parent)
    removed = []
    try:
        for entry in sorted(_names(fd)):
            try:
                mode = os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                    os.unlink(entry, dir_fd=fd)
                    removed.append(f"{directory.rstrip('/')}/{entry}")
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise FileWriteError(f"cannot remove {directory}/{entry}: {_write_fix(exc)}") from None
    finally:
        os.close(fd)
    return removed


_NO_DAC_OVERRIDE = (
    "permission denied; a directory on its path is not root's and this process lacks "
    "CAP_DAC_OVERRIDE (tpuboot.service has it: keep it in CapabilityBoundingSet=)"
)


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link in a directory others can write; refusing to follow it (remove it)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _NO_DAC_OVERRIDE
    return f"{exc.strerror or exc}"


def _write_fix(exc: OSError) -> str:
    """What went wrong replacing the file, and the fix, as the end of one line."""
    if exc.errno == errno.EISDIR:
        return "a directory is in the way; remove it"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return _NO_DAC_OVERRIDE
    return f"{exc.strerror or exc}; check the directory and its permissions"


def _trusted(dir_fd: int) -> bool:
    """Only root or we can create entries here: symlinks in it were not planted by others."""
    st = os.fstat(dir_fd)
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o022


def _resolve(
    root: Root,
    path: str,
    *,
    create: bool,
    dir_mode: int = 0o755,
    follow_last: bool = True,
    error: type[FileError] = FileWriteError,
) -> tuple[int, str]:
    """Walk ``path`` from the Root; return an fd of the directory holding its last component, and its name.

    Links resolve as :meth:`Root.path` resolves them (inside the root); ``follow_last=False``
    stops at a link that is the last component. Raises FileNotFoundError when a directory is
    missing and ``create`` is false, and ``error`` (a reader passes FileReadError) when a
    symlink would have to be followed in an untrusted directory.
    """
    if not path.startswith("/"):
        raise ValueError(f"tpuboot paths must be absolute, got {path!r}")
    queue = deque(split(path))
    if not queue or queue[-1] == "..":
        raise error(f"{path} does not name a file; give a file path")
    stack = [os.open(root.prefix, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    where: list[str] = []  # the names of stack[1:], for a message that names a link
    hops = 0
    try:
        while queue:
            name = queue.popleft()
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    where.pop()
                continue
            link = _symlink(stack[-1], name)
            if link is not None and not queue and (not follow_last or not _trusted(stack[-1])):
                return os.dup(stack[-1]), name  # a planted last component: replaced, never followed
            if link is not None:
                if not _trusted(stack[-1]):
                    raise error(
                        f"{path}: {name} is a symbolic link in a directory others can write; "
                        "refusing to follow it (remove it)"
                    )
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    loop = ReadLoop if issubclass(error, FileReadError) else WriteLoop
                    raise loop(path, "/" + "/".join([*where, name]))
                if link.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                    where.clear()
                queue.extendleft(reversed(split(link)))
                if not queue or queue[-1] == "..":
                    raise error(f"{path}: symbolic link {name} does not lead to a file; fix it")
                continue
            if not queue:
                return os.dup(stack[-1]), name
            stack.append(_open_dir(stack[-1], name, path, create, dir_mode, error))
            where.append(name)
        raise error(f"{path} does not name a file; give a file path")
    finally:
        for fd in stack:
            os.close(fd)


def _symlink(dir_fd: int, name: str) -> str | None:
    """The target of ``name`` if it is a symlink, else None (also when it does not exist)."""
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # exists, not a symlink
            return None
        raise


def _open_dir(parent: int, name: str, path: str, create: bool, dir_mode: int, error: type[FileError]) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except NotADirectoryError:
        raise error(f"{path}: {name} is not a directory; remove it") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink appeared between readlink and open
            raise error(f"{path}: {name} changed into a symbolic link; refusing to follow it") from None
        raise
    made = True
    try:
        os.mkdir(name, dir_mode, dir_fd=parent)
    except FileExistsError:
        made = False  # created concurrently: open it below, still without following links
    os.fsync(parent)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise error(f"{path}: cannot open {name}: {_why(exc)}") from None
    if made:
        os.fchmod(fd, dir_mode)  # the mode asked for, not narrowed by the umask
    return fd


def _stat_regular(parent: int, name: str) -> os.stat_result | None:
    """The existing target's stat if it is a regular file (a symlink or a missing name: None)."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _same(
    parent: int, name: str, current: os.stat_result, data: bytes, mode: int, owner: tuple[int, int] | None
) -> bool:
    if current.st_size != len(data) or stat.S_IMODE(current.st_mode) != mode:
        return False
    if owner is not None and (current.st_uid, current.st_gid) != owner:
        return False
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return False
    try:
        return _read_all(fd, len(data) + 1) == data
    finally:
        os.close(fd)


def _read_all(fd: int, limit: int) -> bytes:
    chunks = []
    total = 0
    while total < limit:
        chunk = os.read(fd, min(1 << 16, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _create_temp(parent: int, name: str) -> tuple[int, str]:
    """A new temp file beside ``name``; O_EXCL|O_NOFOLLOW so a planted name is never opened."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_TRIES):
        temp = f".{name}.tpuboot-{secrets.token_hex(_TEMP_HEX // 2)}"
        try:
            return os.open(temp, flags, 0o600, dir_fd=parent), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {name}")


def _replace(
    parent: int, name: str, data: bytes, mode: int, owner: tuple[int, int] | None, sweep: Sweep
) -> None:
    fd, temp = _create_temp(parent, name)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if owner is not None:
                st = os.fstat(fd)
                if (st.st_uid, st.st_gid) != owner:
                    os.fchown(fd, *owner)
            os.fchmod(fd, mode)  # after fchown, which may clear set-id bits
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=parent)
        raise
    with contextlib.suppress(OSError):  # the file is in place; leftovers wait for the next write
        sweep(parent, name)
    os.fsync(parent)


def sweep_stale_temps(parent: int, name: str) -> None:
    """Remove temp files of ``name`` that a crash left behind: ours (same owner), regular, and
    older than STALE_TEMP_S. Anything else with a similar name, a symlink included, stays."""
    prefix = f".{name}.tpuboot-"
    now = time.time()
    for entry in _names(parent):
        suffix = entry.removeprefix(prefix)
        if suffix == entry or len(suffix) != _TEMP_HEX or not all(c in "0123456789abcdef" for c in suffix):
            continue
        try:
            st = os.stat(entry, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > STALE_TEMP_S:
                os.unlink(entry, dir_fd=parent)
        except FileNotFoundError:
            continue  # gone meanwhile


def _names(dir_fd: int) -> Iterator[str]:
    """The names in a directory, one at a time: a user's directory may hold millions."""
    with os.scandir(dir_fd) as entries:  # on a duplicate of dir_fd, rewound: dir_fd stays as it was
        for entry in entries:
            yield entry.name
