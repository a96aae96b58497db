"""An agent as a privileged host-network container of a :class:`~tpuboot.containers.engine.ContainerEngine`.

The supervision policy, in no engine's terms (:func:`runtime_on` puts it over the host's engine,
:data:`tpuboot.containers.hostengine.HOST_ENGINE`). The container has a fixed name and tpuboot's labels
(:data:`~tpuboot.containers.engine.MANAGED_LABEL`, :data:`~tpuboot.containers.engine.CONFIG_LABEL`):

- the image must come from a registry in its allowlist (:mod:`tpuboot.references`): otherwise
  nothing is pulled, created, adopted or started, and ``start`` raises Refused;
- one already running with the wanted image and settings is adopted (a tpuboot restart does
  not restart the container), a stopped one started again; one whose image or settings differ,
  or that the engine refuses to start again, is removed and created again;
- a missing image is pulled, ``pull_retries`` times at most, with the credentials
  ``credentials`` gives for its registry (:mod:`tpuboot.containers.credentials`: the VM's
  service-account token for Google's registries; none without it);
- ``wait`` follows the engine's exits of the container; the stream ending means the engine
  went away.

Closing leaves the container running: it must survive a tpuboot restart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpuboot.containers.credentials import ANONYMOUS, PullCredentials, ServiceAccountCredentials
from tpuboot.containers.engine import (
    Container,
    ContainerEngine,
    ContainerSpec,
    EngineNotFound,
    EngineProtocolError,
    EngineUnreachable,
    ExitStream,
)
from tpuboot.containers.supervisor import CannotStart, Refused, RuntimeUnavailable, Started, StartFailed
from tpuboot.errors import printable
from tpuboot.references import ImageRefused, RegistryAllowlist

if TYPE_CHECKING:
    from tpuboot.containers.hostengine import HostEngine
    from tpuboot.paths import Root

log = logging.getLogger("tpuboot.containers.runtime")

PULL_PAUSE_MAX = 8.0


def _unreachable(exc: BaseException) -> bool:
    """An error saying the engine is not there (as opposed to an answer from it)."""
    return isinstance(exc, (EngineUnreachable, OSError))


def _reason(exc: BaseException) -> str:
    """One line for a status or log: the engine's own message when it answered, escaped (another
    party's text: it may echo a name or reference from tpu-env)."""
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip().splitlines()
    return printable(text[0]) if text else type(exc).__name__


class EngineRuntime:
    """A :class:`~tpuboot.containers.supervisor.Runtime` over one engine."""

    def __init__(
        self,
        spec: Callable[[], ContainerSpec],
        engine_factory: Callable[[], ContainerEngine],  # reached at its first call (connect)
        *,
        allowlist: RegistryAllowlist,
        unreachable: Callable[[], str],
        pull_retries: int = 5,
        pause: Callable[[float], object] | None = None,
        credentials: ServiceAccountCredentials | None = None,
        engine_name: str = "the container engine",
        load_hint: str = "load it into the engine",
    ) -> None:
        """``unreachable()``: what STATUS says while the engine does not answer (not started, not
        installed); ``engine_name``: the engine in the other messages ("dockerd"); ``load_hint``:
        how to give it an image by hand, for a pull that failed."""
        self.spec = spec
        self.engine_factory = engine_factory
        self.allowlist = allowlist
        self.unreachable = unreachable
        self.pull_retries = pull_retries
        self.credentials = credentials
        self.engine_name = engine_name
        self.load_hint = load_hint
        self.engine: ContainerEngine | None = None
        self.container_id: str | None = None
        self._running: ContainerSpec | None = None  # the spec of the container being followed
        self._refused: ContainerSpec | None = None  # the spec start() last refused
        self.fields: dict[str, str] = {"CONTAINER": spec().name}
        self._stream: ExitStream | None = None
        self._interrupted = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pause = pause or self._closed.wait

    # ------------------------------------------------------------------ Runtime

    def start(self) -> Started:
        self._interrupted.clear()
        if self._closed.is_set():
            raise RuntimeUnavailable("stopping")
        spec = self.spec()
        self.fields = {"CONTAINER": spec.name, "IMAGE": spec.image}
        self._running = None
        self._refused = None
        try:
            self.allowlist.check(spec.image, spec.origin)  # before the engine is even asked
        except ImageRefused as exc:
            self._refused = spec
            raise Refused(str(exc)) from None
        if spec.problem:
            raise CannotStart(spec.problem)
        try:
            started = self._start(spec)
        except (RuntimeUnavailable, CannotStart, StartFailed):
            raise
        except Exception as exc:
            if isinstance(exc, EngineProtocolError):  # answering, but not as the engine: reconnect later
                self._drop_engine()
                raise RuntimeUnavailable(_reason(exc)) from None
            if _unreachable(exc):
                self._drop_engine()
                raise RuntimeUnavailable(self.unreachable()) from None
            raise StartFailed(f"{spec.name}: {_reason(exc)}") from None
        self._running = spec
        return started

    def wait(self) -> str | None:
        engine, ident = self.engine, self.container_id
        if engine is None or ident is None:
            return None
        try:
            stream = engine.exits(ident)
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            self._drop_engine()
            raise RuntimeUnavailable(f"{self.engine_name} not answering ({_reason(exc)})") from None
        with self._lock:
            self._stream = stream
        broken: str | None = None  # why the stream failed, when the engine sent what no event is
        try:
            if self._interrupted.is_set():
                return None
            # Subscribed first, then looked: a death before the subscription shows here.
            found = engine.inspect(ident)
            if not found.running:
                return f"exit {found.exit_code}"
            for code in stream:  # ends when the engine ends the stream or goes away, or at _cut
                return f"exit {code}"
        except Exception as exc:
            if self._interrupted.is_set():
                return None
            if not _unreachable(exc):
                return f"gone ({_reason(exc)})"  # removed by hand: start again
            if isinstance(exc, EngineProtocolError):
                broken = _reason(exc)
        finally:
            with self._lock:
                self._stream = None
            stream.close()
        if self._interrupted.is_set():
            return None
        self._drop_engine()
        raise RuntimeUnavailable(
            f"{self.engine_name}'s event stream failed: {broken}"
            if broken
            else f"{self.engine_name} went away"
        )

    def interrupt(self) -> bool:
        """Only when the wanted container changed from the one followed or refused: a tpu-env
        change elsewhere leaves it be."""
        current = self._running or self._refused
        if current is not None and not self._closed.is_set():
            try:
                if self.spec() == current:
                    return False
            except Exception:  # the spec cannot be read now: look again in start()
                pass
        self._cut()
        return True

    def _cut(self) -> None:
        self._interrupted.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()  # a wait() blocked reading the stream returns at once

    def close(self) -> None:
        """Stop following the container; the container itself keeps running."""
        self._closed.set()
        self._cut()

    def kill(self) -> None:
        engine, ident = self.engine, self.container_id
        if engine is not None and ident is not None:
            with contextlib.suppress(EngineNotFound):  # removed meanwhile: wait() says gone
                engine.kill(ident)

    # ------------------------------------------------------------------ helpers

    def _engine(self) -> ContainerEngine:
        if self.engine is None:
            engine = self.engine_factory()
            engine.connect()  # raises here when the engine is absent
            self.engine = engine
        return self.engine

    def _drop_engine(self) -> None:
        """Forget the connection: the next start reaches the engine afresh (it may be another version)."""
        self.engine = None

    def _start(self, spec: ContainerSpec) -> Started:
        engine = self._engine()
        try:
            found: Container | None = engine.inspect(spec.name)
        except EngineNotFound:
            found = None
        how = "started"
        if found is not None:
            if spec.matches(found):
                self.container_id = found.ident
                if found.running:
                    return Started("adopted", found.ident[:12])
                try:
                    engine.start(found.ident)
                    return Started("restarted", found.ident[:12])
                except Exception as exc:
                    if _unreachable(exc):
                        raise
                    # The engine answered that this container cannot start (containerd's task left
                    # behind by a dockerd restart: "task ...: already exists"; a bind's source gone):
                    # a new container has none of that, and nothing in the old one is worth keeping.
                    log.warning(
                        "%s: cannot be started again (%s); recreating it",
                        spec.name,
                        _reason(exc),
                        extra={"CONTAINER": spec.name, "IMAGE": spec.image},
                    )
            else:
                log.info(
                    "%s: image or settings differ from the configuration; recreating it",
                    spec.name,
                    extra={"CONTAINER": spec.name, "IMAGE": spec.image},
                )
            with contextlib.suppress(EngineNotFound):  # gone meanwhile: as good
                engine.remove(found.ident)
            how = "recreated"
        self._ensure_image(engine, spec.image)
        ident = engine.create(spec)
        self.container_id = ident
        engine.start(ident)
        return Started(how, ident[:12])

    def _ensure_image(self, engine: ContainerEngine, image: str) -> None:
        if engine.has_image(image):
            return
        tries = self.pull_retries + 1
        reason = ""
        sent: PullCredentials = ANONYMOUS
        for attempt in range(tries):
            if self._closed.is_set():
                raise RuntimeUnavailable("stopping")
            sent = self.credentials.for_image(image) if self.credentials is not None else ANONYMOUS
            try:
                engine.pull(image, sent.auth)
                how = " with the VM's service-account token" if sent.auth is not None else ""
                log.info("pulled %s%s", image, how, extra={"IMAGE": image})
                return
            except Exception as exc:
                if _unreachable(exc):
                    raise
                reason = _reason(exc)
                if sent.auth is not None and self.credentials is not None and sent.advice(reason):
                    self.credentials.forget(sent.auth)  # refused: ask for a token afresh
            if attempt + 1 < tries:
                self._pause(min(PULL_PAUSE_MAX, 2.0**attempt))
                if engine.has_image(image):  # loaded meanwhile (docker load / import at boot)
                    return
        raise CannotStart(
            f"cannot pull image {image} ({tries} tries: {reason}){sent.advice(reason)}; "
            f"make it reachable, {self.load_hint}, or set another image"
        )


def runtime_on(
    engine: HostEngine,
    root: Root,
    spec: Callable[[], ContainerSpec],
    *,
    allowlist: RegistryAllowlist,
    pull_retries: int = 5,
    credentials: ServiceAccountCredentials | None = None,
    client: Callable[[], ContainerEngine] | None = None,
    pause: Callable[[float], object] | None = None,
) -> EngineRuntime:
    """The supervision policy over the host's ``engine``; ``client``: another way to reach it (tests)."""
    return EngineRuntime(
        spec,
        client or (lambda: engine.open(root)),
        allowlist=allowlist,
        unreachable=lambda: engine.unreachable(root),
        pull_retries=pull_retries,
        pause=pause,
        credentials=credentials,
        engine_name=engine.name,
        load_hint=f"load it with `{engine.cli} load`",
    )
