"""The runtime environment from metadata: tpu-env, its cache, and /etc/environment, in one place.

This replaces the documented cloud-init scripts (configure-env-vars.sh,
configure-gcs-timeouts.sh). ``sync_once`` runs at boot; ``watch`` keeps tpu-env current.

- tpu-env comes from the ``tpu-env`` instance attribute and is written to
  ``env.tpu_env_path``. The last good raw YAML is kept in ``env.cache_dir/tpu-env.json``
  with its ETag, fetch time and the instance it was fetched on, so a boot with the metadata
  server down still writes tpu-env. A value that fails to parse is never cached and never
  replaces a good file.
- The cache is used only on the instance that wrote it: a disk captured from a running TPU VM
  would otherwise give every clone its parent's tpu-env (WORKER_ID among others). The cache is
  read only when the metadata server is silent, so the identity must be local: the SMBIOS
  system UUID (``/sys/class/dmi/id/product_uuid``), which GCE sets per instance and QEMU with
  ``-uuid``. That is what cloud-init trusts offline for the same question (its datasources'
  ``check_instance_id`` compares the cached instance-id with the DMI system UUID without the
  network); google-guest-agent compares metadata's ``instance/id`` with a stored one, which
  needs the server, so it cannot help here. A record with another UUID, one with none (format
  1, written by an older tpuboot), or any record on a machine without a usable UUID (absent,
  unreadable, all zeros) is not used: on an upgraded VM that costs at most the fallback of one
  offline boot before the next good fetch rewrites the record, while using it on a clone is
  exactly the bug. Each refusal is logged once with its reason; the result is what it is with
  no cache, and the next good fetch replaces the record. ``read_cache`` is the one reader
  (doctor uses it too); a record of the wrong shape counts as corrupt.
- An absent attribute (404) is an answer: /etc/environment is still written, and an
  existing tpu-env file is left as it is (it is not deleted).
- /etc/environment gets ``env.environment`` whatever metadata says.
- The same values go to ``env.systemd_env_path`` (systemd's ``EnvironmentFile=``) and
  ``env.docker_env_path`` (``docker run --env-file``), each in its reader's syntax
  (:mod:`tpuboot.env.tpuenv`), written with tpu-env: root's, 0644, atomically. A value one of
  them cannot carry (a newline for docker, a Unicode noncharacter for systemd, whose reader
  would refuse the whole file) is left out of that file only, named in one warning. A
  failure to write either is logged and added to the status line; tpu-env itself still counts.

``watch`` ends when ``stop`` is set and the client is closed (``client.close()`` cuts a
long-poll in flight; nothing polls ``stop``, so an idle watch never wakes up). Start it
after ``sync_once`` has returned: it continues from that sync's ETag (without one it first
reads and writes the current value).

``parsed_values`` gives the values behind the tpu-env file to the parts of tpuboot that act on
them as root (vBar's image): those of the last sync that wrote the file, else those of the
cache. Never the file itself: its directory may belong to the runtime user, who could rewrite it.

Neither can be ended by a value or a fault: every failure the metadata server or the value
can cause is handled where it arises. Anything else is a bug; ``sync_once`` then falls back
to the cache like any other failure, and ``watch`` logs it once with its traceback and
resumes after a backoff (1 s doubling to 5 min) from the last value it wrote.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import re
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tpuboot import bootbudget, metrics
from tpuboot.atomicfile import FileReadError, FileWriteError, read_file, write_file
from tpuboot.backoff import RestartPolicy
from tpuboot.config import Config
from tpuboot.env.etc_environment import ensure_environment
from tpuboot.env.metadata import Change, MetadataAbsent, MetadataClient
from tpuboot.env.tpuenv import (
    TpuEnvError,
    parse_tpu_env,
    render_docker_env_file,
    render_env_file,
    render_systemd_env_file,
)
from tpuboot.errors import MetadataError, TpubootError
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.env.sync")

TPU_ENV_ATTRIBUTE = "instance/attributes/tpu-env"
CACHE_NAME = "tpu-env.json"
#: 2: the record names its instance (``product_uuid``); 1 (older tpuboot): it does not.
CACHE_FORMAT = 2
#: The SMBIOS system UUID: set per instance by GCE (and QEMU's ``-uuid``), readable by root only.
PRODUCT_UUID_PATH = "/sys/class/dmi/id/product_uuid"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: What firmware puts there when it has no UUID to give: never an instance's identity.
_NO_UUID = frozenset({"00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"})
TPU_ENV_MODE = 0o644  # the runtime user must read it; only root writes it
CACHE_MODE = 0o600
#: The watch's wait after an unexpected exception: first, doubling up to the maximum.
WATCH_RETRY_FIRST = 1.0
WATCH_RETRY_MAX = 300.0


@dataclass(frozen=True)
class SyncResult:
    """What one sync did. ``source``: metadata, cache, absent or failed; ``status``: one line for people."""

    source: str
    keys: int
    etag: str | None
    status: str
    tpu_env_written: bool = False
    environment_written: bool = False
    #: The metadata value was the one last written (a long-poll's new ETag over the same body):
    #: the files are checked, nothing is rewritten, nothing is logged.
    confirmed: bool = False


@dataclass(frozen=True)
class Cached:
    """A cache record: the raw YAML, its ETag, when it was fetched and on which instance."""

    yaml: str
    etag: str | None
    fetched: str  # ISO 8601 UTC
    product_uuid: str | None  # the instance that fetched it (None: a format-1 record)


@dataclass(frozen=True)
class CacheState:
    """The cache as this instance sees it: ``cached`` when usable, else why not (``problem``).
    Both None: there is no record."""

    cached: Cached | None
    problem: str | None = None


def instance_identity(root: Root) -> str | None:
    """This machine's SMBIOS system UUID in lower case, or None when it has none worth trusting."""
    try:
        with open(root.path(PRODUCT_UUID_PATH), "rb") as file:
            raw = file.read(128)
    except OSError:
        return None
    text = raw.decode("ascii", "replace").strip().lower()
    if not _UUID.fullmatch(text) or text in _NO_UUID:
        return None
    return text


def cache_path(config: Config) -> str:
    return config.env.cache_dir.rstrip("/") + "/" + CACHE_NAME


def read_cache(root: Root, config: Config) -> CacheState:
    """The cache record if it is this instance's, else the reason it is not used; logs nothing."""
    path = cache_path(config)
    try:
        raw = read_file(root, path, limit=8 * max(config.metadata.max_body, 1 << 16))
    except FileReadError as exc:
        return CacheState(None, f"tpu-env cache: {exc}")
    if raw is None:
        return CacheState(None)
    record = _parse_record(raw)
    if record is None:
        return CacheState(None, f"tpu-env cache {path} is corrupt")
    here = instance_identity(root)
    if here is None:
        return CacheState(
            None,
            f"tpu-env cache {path}: this machine has no usable system UUID ({PRODUCT_UUID_PATH}), "
            "so tpuboot cannot tell whether the record is its own",
        )
    if record.product_uuid is None:
        return CacheState(
            None,
            f"tpu-env cache {path} does not name its instance (an older tpuboot wrote it, "
            "perhaps on the image's build VM, or this machine had no system UUID then)",
        )
    if here != record.product_uuid:
        return CacheState(
            None,
            f"tpu-env cache {path} belongs to another instance (system UUID {record.product_uuid}, "
            f"this one is {here}: a disk cloned or moved from it)",
        )
    return CacheState(record)


def _warn_unused(problem: str, path: str) -> None:
    log.warning(
        "%s; not using it (the next good fetch from metadata replaces it)",
        problem,
        extra={"TPU_ENV_CACHE": path},
    )


def _parse_record(raw: bytes) -> Cached | None:
    """A record of either format, or None if it is not one (bad JSON, a field missing or mistyped)."""
    try:
        record = json.loads(raw)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(record, dict):
        return None
    yaml, etag, fetched = record.get("tpu_env"), record.get("etag"), record.get("fetched")
    form, uuid = record.get("format"), record.get("product_uuid")
    if form not in (1, CACHE_FORMAT) or isinstance(form, bool):
        return None
    if (
        not isinstance(yaml, str)
        or not isinstance(fetched, str)
        or not (etag is None or isinstance(etag, str))
    ):
        return None
    if form == 1:
        return Cached(yaml, etag, fetched, None)
    if uuid is not None and not (isinstance(uuid, str) and _UUID.fullmatch(uuid)):
        return None
    return Cached(yaml, etag, fetched, uuid)  # None: written on a machine without a system UUID


def _now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _short_time(iso: str) -> str:
    """``2026-11-29T20:00Z`` from a stored timestamp (as given if it does not parse)."""
    try:
        when = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


class EnvSync:
    """Writes tpu-env, its cache and /etc/environment from a MetadataClient (thread-safe)."""

    def __init__(
        self,
        root: Root,
        config: Config,
        client: MetadataClient,
        *,
        clock: Callable[[], datetime.datetime] = _now_utc,
    ) -> None:
        self._root = root
        self._env = config.env
        self._metadata = config.metadata
        self._client = client
        self._clock = clock
        self._lock = threading.Lock()
        self._etag: str | None = None
        self._values: Mapping[str, str] | None = None  # what the last good sync wrote (read-only)
        self._body: bytes | None = None  # the metadata value behind the cache record this run wrote
        self._reported: SyncResult | None = None
        self.watch_retry = (WATCH_RETRY_FIRST, WATCH_RETRY_MAX)
        self._unexpected_seen: set[str] = set()
        self._untrusted_seen: set[str] = set()
        self._unused_seen: set[str] = set()
        self._config = config

    @property
    def cache_path(self) -> str:
        return cache_path(self._config)

    def parsed_values(self) -> Mapping[str, str] | None:
        """tpu-env's values as tpuboot parsed them: those the last good sync wrote, else those of the
        root-only cache (a start before any sync succeeded); None if neither. Never raises."""
        with self._lock:
            values = self._values
        if values is not None:
            return values
        try:
            if not self._cache_root_only():
                return None
            cached = self._load_cache()
            return None if cached is None else types.MappingProxyType(parse_tpu_env(cached.yaml).values)
        except TpuEnvError:
            return None  # a cache that does not parse is never used (_from_cache says so)
        except Exception as exc:  # a bug: the caller falls back to the configuration
            self._unexpected(exc, "tpu-env cache")
            return None

    def _cache_root_only(self) -> bool:
        """Whether only tpuboot's user (or root) can have written the cache: its directory and the
        file (if present) are theirs and writable by no one else. A cache_dir moved somewhere shared
        is still used for tpu-env, but never for what tpuboot runs as root."""
        for path in (self._env.cache_dir, self.cache_path):
            try:
                st = os.lstat(self._root.path(path, follow=False))
            except FileNotFoundError:
                continue
            except OSError:
                return False
            if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
                if path not in self._untrusted_seen:
                    self._untrusted_seen.add(path)
                    log.warning(
                        "tpu-env cache: %s is not root-only (another owner, or writable by others), "
                        "so vBar's image is not taken from it; chown root and chmod go-w it",
                        path,
                        extra={"TPU_ENV_CACHE": self.cache_path},
                    )
                return False
        return True

    def sync_once(self, deadline_s: float) -> SyncResult:
        """Fetch tpu-env within ``deadline_s`` seconds, write every file; never raises (see module doc)."""
        try:
            result = self._sync_tpu_env(deadline_s)
        except Exception as exc:  # a bug, never a property of the metadata: go on as for any failure
            self._unexpected(exc, "tpu-env sync")
            result = self._after_bug(exc)
        result = self._with_environment(result)
        self._report(result)
        return result

    def _sync_tpu_env(self, deadline_s: float) -> SyncResult:
        try:
            reply = self._client.get(TPU_ENV_ATTRIBUTE, deadline_s=deadline_s)
        except MetadataAbsent:
            return self._absent()
        except MetadataError as exc:
            reason = "metadata server unreachable" if exc.transient else "metadata answer unusable"
            log.warning("tpu-env: %s", exc, extra={"TPU_ENV_PATH": self._env.tpu_env_path})
            return self._from_cache(reason)
        return self._from_metadata(reply.body, reply.etag)

    def _after_bug(self, exc: Exception) -> SyncResult:
        """The cached copy after an unexpected exception, or a failed result if that fails too."""
        try:
            return self._from_cache(f"unexpected {type(exc).__name__} (see the log)")
        except Exception as again:
            self._unexpected(again, "tpu-env cache")
            path = self._env.tpu_env_path
            return SyncResult(
                "failed", 0, None, f"tpu-env: tpuboot failed ({type(exc).__name__}); left {path} as it was"
            )

    def watch(self, stop: threading.Event, on_result: Callable[[SyncResult], None]) -> None:
        """Rewrite tpu-env on each change of the attribute until ``stop`` is set; ``on_result`` after each.

        Never raises: an unexpected exception (a bug) is logged once with its traceback, reported
        as a failed result, and the watch starts again after a backoff from the last ETag written.
        """
        backoff = RestartPolicy(*self.watch_retry, stable_after=math.inf)
        while not stop.is_set():
            try:
                changes = self._client.changes(
                    TPU_ENV_ATTRIBUTE, stop=stop, etag=self._etag, timeout_sec=self._metadata.watch_timeout
                )
                for change in changes:
                    result = self._apply_change(change)
                    self._report(result)
                    on_result(result)
                    backoff.reset()
                    self._unexpected_seen.clear()
                return  # the changes end only when stop is set or the client is closed
            except Exception as exc:
                if stop.is_set():
                    return  # shutting down: the loop reports go to may be closed already
                delay = backoff.delay_after(0.0)
                self._unexpected(exc, f"tpu-env watch (retrying in {delay:g} s)")
                path = self._env.tpu_env_path
                failed = SyncResult(
                    "failed",
                    0,
                    self._etag,
                    f"tpu-env: watch failed ({type(exc).__name__}); left {path} as it was",
                )
                if backoff.exits == 1:  # once per streak: STATUS shows it, the log is not flooded
                    self._tell(on_result, failed)
                if stop.wait(delay):
                    return

    def _tell(self, on_result: Callable[[SyncResult], None], result: SyncResult) -> None:
        try:
            self._report(result)
            on_result(result)
        except Exception as exc:
            self._unexpected(exc, "tpu-env watch report")

    def _unexpected(self, exc: Exception, where: str) -> None:
        """Log an unexpected exception with its traceback the first time; repeats at debug level."""
        kind = f"{where.split(' (')[0]}: {type(exc).__name__}: {exc}"[:300]
        if kind in self._unexpected_seen:
            log.debug("%s: %s again", where, type(exc).__name__)
            return
        self._unexpected_seen.add(kind)
        log.error(
            "%s: unexpected %s: %s; this is a bug in tpuboot, please report it",
            where,
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
            exc_info=exc,
            extra={"TPU_ENV_PATH": self._env.tpu_env_path},
        )

    def _apply_change(self, change: Change) -> SyncResult:
        if change.value is None:
            return self._absent()
        return self._from_metadata(change.value, change.etag)

    def _absent(self) -> SyncResult:
        bootbudget.mark(bootbudget.METADATA)  # a 404 is an answer: the attribute is not set
        with self._lock:
            self._etag = None
        return SyncResult(
            "absent",
            0,
            None,
            f"tpu-env: no tpu-env attribute in metadata; left {self._env.tpu_env_path} as it was",
        )

    def _from_metadata(self, body: bytes, etag: str | None) -> SyncResult:
        bootbudget.mark(bootbudget.METADATA)
        try:
            env = parse_tpu_env(body, max_bytes=self._metadata.max_body)
        except TpuEnvError as exc:
            log.warning(
                "%s", exc, extra={"TPU_ENV_PATH": self._env.tpu_env_path, "METADATA_ETAG": etag or ""}
            )
            return self._from_cache("metadata tpu-env is invalid")
        with self._lock:
            try:
                written, more = self._write_tpu_env(env.values)
            except FileWriteError as exc:
                return SyncResult("failed", len(env.values), etag, f"tpu-env: {exc}")
            self._etag = etag
            self._values = types.MappingProxyType(env.values)
            confirmed = body == self._body  # the value the cache holds: only its ETag moved, if that
            if not confirmed:
                self._save_cache(body.decode("utf-8"), etag)
                self._body = body
        status = f"tpu-env: {_keys(len(env.values))} from metadata{more}"
        return SyncResult("metadata", len(env.values), etag, status, written, confirmed=confirmed)

    def _from_cache(self, reason: str) -> SyncResult:
        path = self._env.tpu_env_path
        cached = self._load_cache()
        if cached is None:
            return SyncResult(
                "failed", 0, None, f"tpu-env: {reason} and no cached copy; left {path} as it was"
            )
        try:
            env = parse_tpu_env(cached.yaml)
        except TpuEnvError as exc:
            log.warning("cached %s", exc, extra={"TPU_ENV_CACHE": self.cache_path})
            return SyncResult(
                "failed", 0, None, f"tpu-env: {reason} and the cached copy is invalid; left {path} as it was"
            )
        with self._lock:
            try:
                written, more = self._write_tpu_env(env.values)
            except FileWriteError as exc:
                return SyncResult("failed", len(env.values), cached.etag, f"tpu-env: {exc}")
            self._values = types.MappingProxyType(env.values)
        when = _short_time(cached.fetched)
        status = f"tpu-env: {reason}, {_keys(len(env.values))} from cache of {when}{more}"
        return SyncResult("cache", len(env.values), cached.etag, status, written)

    def _write_tpu_env(self, values: dict[str, str]) -> tuple[bool, str]:
        """Write tpu-env (FileWriteError if that fails), then the systemd and docker files; whether
        tpu-env was rewritten, and what to add to the status line (empty: all written)."""
        data = render_env_file(values).encode("utf-8")
        owner = (os.geteuid(), os.getegid())
        written = write_file(self._root, self._env.tpu_env_path, data, mode=TPU_ENV_MODE, owner=owner)
        bootbudget.mark(bootbudget.TPU_ENV)  # written or already so: either way it holds the values
        failed = [f"{path} not written: {exc}" for path, exc in self._write_formats(values, owner)]
        return written, "".join(f"; {line}" for line in failed)

    def _write_formats(
        self, values: dict[str, str], owner: tuple[int, int]
    ) -> list[tuple[str, FileWriteError]]:
        """The systemd and docker files that are configured; the failures, each logged."""
        failures: list[tuple[str, FileWriteError]] = []
        for path, (text, skipped) in (
            (self._env.systemd_env_path, render_systemd_env_file(values)),
            (self._env.docker_env_path, render_docker_env_file(values)),
        ):
            if path is None:
                continue
            try:
                rewritten = write_file(self._root, path, text.encode("utf-8"), mode=TPU_ENV_MODE, owner=owner)
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

    def _save_cache(self, text: str, etag: str | None) -> None:
        """Keep the last good value with this instance's identity; a failure here costs only the next
        offline boot, so it only warns."""
        record = {
            "format": CACHE_FORMAT,
            "product_uuid": instance_identity(self._root),
            "fetched": self._clock().isoformat(),
            "etag": etag,
            "tpu_env": text,
        }
        data = (json.dumps(record, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
        try:
            write_file(self._root, self.cache_path, data, mode=CACHE_MODE)
        except FileWriteError as exc:
            log.warning("tpu-env cache: %s", exc, extra={"TPU_ENV_CACHE": self.cache_path})

    def _load_cache(self) -> Cached | None:
        """This instance's cache record; a record not used is named once per reason (the boot sync
        and parsed_values both look)."""
        state = read_cache(self._root, self._config)
        if state.problem is not None and state.problem not in self._unused_seen:
            self._unused_seen.add(state.problem)
            _warn_unused(state.problem, self.cache_path)
        return state.cached

    def _with_environment(self, result: SyncResult) -> SyncResult:
        """Also set env.environment in /etc/environment; a failure there is added to the status line."""
        try:
            changed = ensure_environment(self._root, self._env.environment_path, self._env.environment)
        except TpubootError as exc:
            log.error("%s", exc, extra={"ENVIRONMENT_PATH": self._env.environment_path})
            return dataclasses.replace(
                result, status=f"{result.status}; {self._env.environment_path} not written: {exc}"
            )
        except Exception as exc:  # a bug: tpu-env's result still counts
            self._unexpected(exc, "/etc/environment")
            return dataclasses.replace(
                result,
                status=f"{result.status}; {self._env.environment_path} not written ({type(exc).__name__})",
            )
        bootbudget.mark(bootbudget.ENVIRONMENT)
        return dataclasses.replace(result, environment_written=bool(changed))

    def _report(self, result: SyncResult) -> None:
        if result.source in ("metadata", "cache"):
            metrics.tpu_env_updated(from_cache=result.source == "cache")
        last, self._reported = self._reported, result
        if result.source == "absent" and last is not None and last.status == result.status:
            return  # the watch's first look at an attribute still unset: said already
        unchanged = last is not None and last.status == result.status and not result.tpu_env_written
        if result.confirmed and unchanged:
            log.debug("tpu-env: unchanged under ETag %s", result.etag)  # a flapping ETag: no news
            return
        level = logging.INFO if result.source in ("metadata", "absent") else logging.WARNING
        log.log(
            level,
            "%s",
            result.status,
            extra={
                "TPU_ENV_SOURCE": result.source,
                "TPU_ENV_KEYS": result.keys,
                "METADATA_ETAG": result.etag or "",
            },
        )


def _keys(count: int) -> str:
    return f"{count} key" if count == 1 else f"{count} keys"
