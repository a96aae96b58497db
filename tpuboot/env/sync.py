"""The runtime environment from metadata: tpu-env, its cache, and /etc/environment, in one place.

This replaces the documented cloud-init scripts (configure-env-vars.sh,
configure-gcs-timeouts.sh). ``sync_once`` runs at boot; :func:`tpuboot.env.watch.watch_tpu_env` keeps
tpu-env current (start it after ``sync_once`` has returned: it continues from that sync's ETag).

- tpu-env comes from the ``tpu-env`` instance attribute and is written to ``env.tpu_env_path``
  and its two other formats (:mod:`tpuboot.env.writers`). The last good raw YAML is kept in the
  cache (:mod:`tpuboot.env.cache`, used only on the instance that wrote it), so a boot with the
  metadata server down still writes tpu-env. A value that fails to parse is never cached and
  never replaces a good file. Each cache record not used is logged once with its reason; the
  result is what it is with no cache, and the next good fetch replaces the record.
- An absent attribute (404) is an answer: /etc/environment is still written, and an
  existing tpu-env file is left as it is (it is not deleted).
- /etc/environment gets ``env.environment`` whatever metadata says.

``parsed_values`` gives the values behind the tpu-env file to the parts of tpuboot that act on
them as root (vBar's image): those of the last sync that wrote the file, else those of the
cache. Never the file itself: its directory may belong to the runtime user, who could rewrite it.

A sync cannot be ended by a value or a fault: every failure the metadata server or the value
can cause is handled where it arises. Anything else is a bug; ``sync_once`` then falls back
to the cache like any other failure (a bug in the /etc/environment writer leaves tpu-env's result
standing), and a bug past that reaches the caller's guard.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import types
from collections.abc import Callable, Iterator, Mapping

from tpuboot import bootbudget
from tpuboot.atomicfile import FileWriteError, write_file
from tpuboot.config import Config
from tpuboot.env.cache import CACHE_MODE, Cached, cache_path, encode_record, read_cache, root_only, short_time
from tpuboot.env.etc_environment import ensure_environment
from tpuboot.env.identity import instance_identity
from tpuboot.env.results import Bugs, Reporter, SyncResult, keys
from tpuboot.env.tpuenv import TpuEnvError, parse_tpu_env
from tpuboot.env.writers import write_tpu_env
from tpuboot.errors import MetadataError, TpubootError
from tpuboot.gce.client import MetadataClient
from tpuboot.gce.keys import TPU_ENV
from tpuboot.gce.replies import Change, MetadataAbsent
from tpuboot.paths import Root

log = logging.getLogger("tpuboot.env.sync")


def _now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


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
        self.report = Reporter()
        self.bugs = Bugs(config.env.tpu_env_path)
        self._untrusted_seen: set[str] = set()
        self._unused_seen: set[str] = set()
        self._config = config

    @property
    def cache_path(self) -> str:
        return cache_path(self._config)

    @property
    def tpu_env_path(self) -> str:
        return self._env.tpu_env_path

    @property
    def etag(self) -> str | None:
        """The ETag of the value last written (None: none, or the attribute is absent)."""
        with self._lock:
            return self._etag

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
            self.bugs(exc, "tpu-env cache")
            return None

    def _cache_root_only(self) -> bool:
        """Whether the cache may give what tpuboot runs as root (:func:`tpuboot.env.cache.root_only`);
        a cache someone else may have written is named once."""
        ok, path = root_only(self._root, self._config)
        if path is not None and path not in self._untrusted_seen:
            self._untrusted_seen.add(path)
            log.warning(
                "tpu-env cache: %s is not root-only (another owner, or writable by others), "
                "so vBar's image is not taken from it; chown root and chmod go-w it",
                path,
                extra={"TPU_ENV_CACHE": self.cache_path},
            )
        return ok

    def sync_once(self, deadline_s: float) -> SyncResult:
        """Fetch tpu-env within ``deadline_s`` seconds, write every file.

        A bug in the fetch or the parse falls back to the cache as any failure does; a bug in the
        /etc/environment writer leaves tpu-env's result as it is, said in the status line; a bug in
        the fallback itself reaches the caller's one guard (the env thread's logs it and starts the
        watch all the same)."""
        try:
            result = self._sync_tpu_env(deadline_s)
        except Exception as exc:  # a bug, never a property of the metadata: go on as for any failure
            self.bugs(exc, "tpu-env sync")
            result = self._from_cache(f"unexpected {type(exc).__name__} (see the log)")
        result = self._with_environment(result)
        self.report(result)
        return result

    def _sync_tpu_env(self, deadline_s: float) -> SyncResult:
        try:
            reply = self._client.get(TPU_ENV, deadline_s=deadline_s)
        except MetadataAbsent:
            return self._absent()
        except MetadataError as exc:
            reason = "metadata server unreachable" if exc.transient else "metadata answer unusable"
            log.warning("tpu-env: %s", exc, extra={"TPU_ENV_PATH": self._env.tpu_env_path})
            return self._from_cache(reason)
        return self._from_metadata(reply.body, reply.etag)

    def changes(self, stop: threading.Event) -> Iterator[Change]:
        """The attribute's changes after the value last written, until ``stop`` (the watch's source)."""
        timeout_sec = self._metadata.watch_timeout
        return self._client.changes(TPU_ENV, stop=stop, etag=self.etag, timeout_sec=timeout_sec)

    def apply(self, change: Change) -> SyncResult:
        """Write what one change of the attribute says (the watch reports the result)."""
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
                written, more = write_tpu_env(self._root, self._env, env.values)
            except FileWriteError as exc:
                return SyncResult("failed", len(env.values), etag, f"tpu-env: {exc}")
            self._etag = etag
            self._values = types.MappingProxyType(env.values)
            confirmed = body == self._body  # the value the cache holds: only its ETag moved, if that
            if not confirmed:
                self._save_cache(body.decode("utf-8"), etag)
                self._body = body
        status = f"tpu-env: {keys(len(env.values))} from metadata{more}"
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
                written, more = write_tpu_env(self._root, self._env, env.values)
            except FileWriteError as exc:
                return SyncResult("failed", len(env.values), cached.etag, f"tpu-env: {exc}")
            self._values = types.MappingProxyType(env.values)
        when = short_time(cached.fetched)
        status = f"tpu-env: {reason}, {keys(len(env.values))} from cache of {when}{more}"
        return SyncResult("cache", len(env.values), cached.etag, status, written)

    def _save_cache(self, text: str, etag: str | None) -> None:
        """Keep the last good value with this instance's identity; a failure here costs only the next
        offline boot, so it only warns."""
        data = encode_record(text, etag, self._clock(), instance_identity(self._root))
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
            log.warning(
                "%s; not using it (the next good fetch from metadata replaces it)",
                state.problem,
                extra={"TPU_ENV_CACHE": self.cache_path},
            )
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
        except Exception as exc:  # a bug in another file's writer: tpu-env's result still counts
            self.bugs(exc, "/etc/environment")
            return dataclasses.replace(
                result,
                status=f"{result.status}; {self._env.environment_path} not written ({type(exc).__name__})",
            )
        bootbudget.mark(bootbudget.ENVIRONMENT)
        return dataclasses.replace(result, environment_written=bool(changed))
