"""The notice hooks: every executable in ``/etc/tpuboot/maintenance.d/`` run for a notice.

Why each choice (doc/notices.md says it for the operator):

- **In name order, one after another, under one shared deadline** (``notices.hook_deadline``,
  25 s by default: a preemption leaves about 30). A hook may depend on the one before it
  (checkpoint, then drain, then tell the scheduler), as run-parts orders them; the host does not
  wait for the sum of per-hook deadlines, so the budget is the whole run's. A hook still running
  at the deadline is killed with its whole process group (SIGKILL: there is no time left for a
  grace period); the hooks after it are not started and are named in one line.
- **Refused, one line each**: a hook runs as root, so the directory (no symbolic link on its
  path) and every hook must be owned by root and writable by nobody else; a symbolic link as a
  hook is refused too (what it points at is not checked here). A file that is not executable is
  skipped with a debug line only: it is most likely a README, as in run-parts. Names starting
  with a dot or ending in ``~`` or a dpkg/ucf leftover suffix are editors' and packages' leavings,
  skipped silently.
- **Told in their environment and arguments**: ``TPUBOOT_NOTICE_KIND``, ``TPUBOOT_NOTICE_VALUE``
  and ``TPUBOOT_NOTICE_WINDOW_START`` (RFC 3339, when known), and the same three as arguments; a
  small fixed environment otherwise (PATH, LANG), never the daemon's.
- **Each hook's result one journal line** with structured fields (HOOK, HOOK_STATUS,
  HOOK_SECONDS, HOOK_KILLED, NOTICE_KIND).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpuboot.errors import printable
from tpuboot.notices.parse import Notice
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.notices.hooks")

HOOKS_DIR = "/etc/tpuboot/maintenance.d"
#: What every hook's environment holds besides the notice.
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
#: Leftovers a package manager or an editor leaves beside a file, never hooks.
_LEFTOVERS = (".dpkg-old", ".dpkg-new", ".dpkg-dist", ".dpkg-tmp", ".ucf-old", ".ucf-new", ".ucf-dist", "~")


@dataclass(frozen=True)
class HookUser:
    """Who the hooks run as: None for root (the daemon's own user), else the names' ids and the
    user's supplementary groups (as initgroups would set them)."""

    name: str | None = None
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()


#: The daemon's own user.
ROOT = HookUser()


def hook_user(name: str | None) -> HookUser:
    """The user ``notices.hook_user`` names, looked up now (ConfigError-like ValueError if unknown)."""
    if name is None or name == "root":
        return ROOT
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(
            f"notices.hook_user: no user {printable(name)!r} on this host; create it or leave it out"
        ) from None
    return HookUser(name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(name, entry.pw_gid)))


@dataclass(frozen=True)
class HookResult:
    """One hook's run: its exit status (negative: the signal that ended it), the seconds it took,
    and whether tpuboot killed it at the deadline."""

    name: str
    status: int
    seconds: float
    killed: bool
    stopping: bool = False  # killed because tpuboot stopped, not at the deadline


class Cancel:
    """Ends a run from another thread (the daemon's stop): the hook running is killed with its
    group, and no other starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._pid is not None:
                _kill_group(self._pid)

    def running(self, pid: int | None) -> bool:
        """Record the hook running now (None: none); False if the run was cancelled meanwhile."""
        with self._lock:
            self._pid = pid
            if self.cancelled and pid is not None:
                _kill_group(pid)
            return not self.cancelled


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def notice_env(notice: Notice) -> dict[str, str]:
    """The notice as the hooks' environment variables (the window only when known)."""
    env = {"TPUBOOT_NOTICE_KIND": notice.kind, "TPUBOOT_NOTICE_VALUE": notice.value}
    if notice.window_start is not None:
        env["TPUBOOT_NOTICE_WINDOW_START"] = notice.window_text()
    return env


def find_hooks(root: Root, directory: str = HOOKS_DIR) -> list[Path]:
    """The hooks to run, in name order; every refusal logged as one line. A missing directory is
    no hooks (quietly: most hosts have none)."""
    link = root.links_on(directory)
    if link is not None:
        log.warning(
            "notice hooks: %s is a symbolic link; refused (a hook runs as root): make it a directory", link
        )
        return []
    real = root.path(directory)
    try:
        info = real.lstat()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("notice hooks: cannot read %s (%s); no hooks run", directory, exc.strerror)
        return []
    if not stat.S_ISDIR(info.st_mode):
        log.warning("notice hooks: %s is not a directory; no hooks run", directory)
        return []
    why = _unsafe(info)
    if why:
        log.warning(
            "notice hooks: %s %s; refused, no hooks run (a hook runs as root): %s",
            directory,
            why,
            _fix(directory),
        )
        return []
    hooks = []
    for name in sorted(os.listdir(real)):
        if name.startswith(".") or name.endswith(_LEFTOVERS):
            continue
        path = real / name
        shown = f"{directory}/{printable(name)}"
        try:
            entry = path.lstat()
        except OSError:
            continue  # removed since the listing
        if stat.S_ISLNK(entry.st_mode):
            log.warning(
                "notice hooks: %s is a symbolic link; refused (a hook runs as root): copy the file there",
                shown,
            )
            continue
        if not stat.S_ISREG(entry.st_mode):
            continue
        if not entry.st_mode & stat.S_IXUSR:
            log.debug("notice hooks: %s is not executable; skipped (a README?)", shown)
            continue
        why = _unsafe(entry)
        if why:
            log.warning("notice hooks: %s %s; refused (a hook runs as root): %s", shown, why, _fix(shown))
            continue
        hooks.append(path)
    return hooks


def _unsafe(info: os.stat_result) -> str:
    """Why root should not run what this stat describes, or ""."""
    if info.st_uid != 0:
        return f"is owned by uid {info.st_uid}, not root"
    if info.st_mode & stat.S_IWOTH:
        return "is world-writable"
    if info.st_mode & stat.S_IWGRP:
        return "is group-writable"
    return ""


def _fix(path: str) -> str:
    return f"chown root:root {path} && chmod go-w {path}"


def run_hooks(
    hooks: Sequence[Path],
    notice: Notice,
    deadline_s: float,
    user: HookUser = ROOT,
    *,
    clock: Callable[[], float] = time.monotonic,
    started: Callable[[str], None] | None = None,
    cancel: Cancel | None = None,
) -> list[HookResult]:
    """Run ``hooks`` one after another for ``notice`` within ``deadline_s`` seconds in all; each
    result one journal line. ``started`` is told each hook's name as it starts (the bench);
    ``cancel`` ends the run early."""
    cancel = cancel or Cancel()
    deadline = clock() + deadline_s
    env = {**BASE_ENV, **notice_env(notice)}
    args = [notice.kind, notice.value, notice.window_text()]
    results: list[HookResult] = []
    for index, hook in enumerate(hooks):
        left = deadline - clock()
        if left <= 0:
            rest = ", ".join(printable(h.name) for h in hooks[index:])
            log.warning(
                "notice hooks: the %g s deadline passed; %d not run: %s (raise notices.hook_deadline, or "
                "make the hooks quicker)", deadline_s, len(hooks) - index, rest,
                extra={"NOTICE_KIND": notice.kind})  # fmt: skip
            break
        if cancel.cancelled:
            break
        if started is not None:
            started(hook.name)
        result = run_hook(hook, args, env, left, user, clock, cancel)
        _log_result(result, notice)
        results.append(result)
    return results


def run_hook(
    hook: Path,
    args: list[str],
    env: dict[str, str],
    timeout: float,
    user: HookUser,
    clock: Callable[[], float],
    cancel: Cancel,
) -> HookResult:
    """One hook in a process group of its own, killed with the whole group at ``timeout`` (or
    when ``cancel`` is)."""
    began = clock()
    try:
        proc = subprocess.Popen(
            [str(hook), *args],
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the deadline ends its children too
            user=user.uid,
            group=user.gid,
            extra_groups=list(user.groups) if user.uid is not None else None,
            close_fds=True,
        )
    except OSError as exc:  # not a valid executable (no #! line), or the user cannot be set
        log.warning("notice hook %s: cannot start (%s)", printable(hook.name), exc.strerror or exc)
        return HookResult(hook.name, 126, clock() - began, False)
    killed = not cancel.running(proc.pid)
    try:
        status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        killed = True
        _kill_group(proc.pid)
        status = proc.wait()
    finally:
        cancel.running(None)
    return HookResult(hook.name, status, clock() - began, killed or cancel.cancelled, cancel.cancelled)


def _log_result(result: HookResult, notice: Notice) -> None:
    name = printable(result.name)
    if result.stopping:
        how = "killed: tpuboot is stopping"
    elif result.killed:
        how = "killed at the deadline"
    elif result.status < 0:
        how = f"ended by signal {-result.status}"
    else:
        how = f"exit status {result.status}"
    fields = {
        "HOOK": name,
        "HOOK_STATUS": str(result.status),
        "HOOK_SECONDS": f"{result.seconds:.3f}",
        "HOOK_KILLED": "1" if result.killed else "0",
        "NOTICE_KIND": notice.kind,
    }
    level = logging.INFO if result.status == 0 and not result.killed else logging.WARNING
    log.log(level, "notice hook %s: %s in %.2f s", name, how, result.seconds, extra=fields)
