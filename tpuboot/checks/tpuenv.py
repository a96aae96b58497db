"""doctor's checks of the runtime environment tpuboot writes: tpu-env (there, parsed, this
instance's and current) and the variables of /etc/environment. The file is read once per doctor
run and its values shared with the checks that need the topology (chip count, slice)."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable

from tpuboot.atomicfile import read_file
from tpuboot.config import Config
from tpuboot.env.cache import cache_path, read_cache
from tpuboot.env.etc_environment import plan_environment
from tpuboot.env.tpuenv import TpuEnvError, parse_env_file, parse_tpu_env, render_env_file
from tpuboot.holders.procfs import boot_time
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Criterion, failed, passed, skipped

TPU_ENV = Criterion("tpu-env", 'tpu-env present, in KEY="value" lines, not empty')
#: Advisory: a job can run on the tpu-env it has.
TPU_ENV_FRESH = Criterion(
    "tpu-env-fresh",
    "tpu-env the last value fetched from metadata, or written during this boot",
    required=False,
)
ENVIRONMENT = Criterion("environment", "/etc/environment setting env.environment's variables")


class TpuEnvChecks:
    """tpu-env, tpu-env-fresh and environment, over one read of each file."""

    def __init__(self, root: Root, config: Config, now: Callable[[], float]) -> None:
        self.root = root
        self.config = config
        self.now = now

    def named(self) -> list[tuple[Criterion, Callable[[], CheckResult]]]:
        return [
            (TPU_ENV, self.check_tpu_env),
            (TPU_ENV_FRESH, self.check_tpu_env_fresh),
            (ENVIRONMENT, self.check_environment),
        ]

    def _read(self, path: str) -> str | None:
        data = read_file(self.root, path)
        return None if data is None else data.decode("utf-8", "replace")

    @functools.cached_property
    def text(self) -> str | None:
        """The tpu-env file as the workload reads it (read once); None if absent or env is off."""
        return self._read(self.config.env.tpu_env_path) if self.config.env.enabled else None

    @functools.cached_property
    def values(self) -> dict[str, str] | None:
        """The file's values, parsed once by tpuenv's parser; None if absent or not KEY="value" lines."""
        text = self.text
        return None if text is None else parse_env_file(text)

    def check_tpu_env(self) -> CheckResult:
        path = self.config.env.tpu_env_path
        if not self.config.env.enabled:
            return skipped("env.enabled is false: tpuboot does not write tpu-env")
        text = self.text
        if text is None:
            return failed(
                f"{path} is missing", "tpuboot env (or systemctl restart tpuboot); check the metadata server"
            )
        values = self.values
        if values is None:
            return failed(f'{path} is not a file of KEY="value" lines', f"tpuboot env rewrites {path}")
        if not values:
            return failed(f"{path} is empty", "set the tpu-env instance attribute, then tpuboot env")
        return passed(f"{path}: {len(values)} keys")

    def check_tpu_env_fresh(self) -> CheckResult:
        """tpu-env holds the last value fetched from metadata (its cache record), else was written
        during this boot."""
        path = self.config.env.tpu_env_path
        if not self.config.env.enabled:
            return skipped("env.enabled is false: tpuboot does not write tpu-env")
        text = self.text
        if text is None:
            return skipped(f"{path} is missing (see the {TPU_ENV.name} check)")
        fix = "tpuboot env (or systemctl restart tpuboot), then check the metadata server"
        cache = cache_path(self.config)
        state = read_cache(self.root, self.config)  # the record tpuboot itself would use, or why not
        if state.problem is not None:
            return failed(f"{state.problem}; {path} may not be this instance's", fix)
        if state.cached is not None:
            try:
                cached = render_env_file(parse_tpu_env(state.cached.yaml).values)
            except TpuEnvError:
                return failed(f"cache record {cache} holds an invalid tpu-env", fix)
            age = self._age(state.cached.fetched)
            if cached == text:
                return passed(f"{path} matches the last value fetched from metadata{age}")
            return failed(f"{path} differs from the last value fetched from metadata{age}", fix)
        booted = boot_time(self.root)
        if booted is None:
            return skipped(f"no cache record {cache} and no boot time to compare {path} with")
        mtime = self.root.path(path).stat().st_mtime
        if mtime >= booted:
            return passed(f"{path} written during this boot (no cache record)")
        return failed(f"{path} predates this boot and has no cache record", fix)

    def _age(self, iso: str) -> str:
        try:
            when = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return ""
        return f" ({max(0, int(self.now() - when))} s ago)"

    def check_environment(self) -> CheckResult:
        path, wanted = self.config.env.environment_path, self.config.env.environment
        if not wanted:
            return skipped("env.environment is empty: nothing to set")
        text = self._read(path) or ""
        plan = plan_environment(text, wanted)
        wrong = plan.changed
        if not wrong:
            kept = "".join(
                f"; {key}={theirs!r} kept as the admin set it (tpuboot's: {ours!r})"
                for key, (theirs, ours) in sorted(plan.admin.items())
            )
            listed = ", ".join(sorted(wanted)[:2])
            return passed(f"{path} sets {len(wanted)} variables ({listed}, ...){kept}")
        return failed(
            f"{path} lacks or differs on {', '.join(wrong)}", f"tpuboot env (it sets them in {path})"
        )
