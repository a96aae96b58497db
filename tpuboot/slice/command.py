"""``tpuboot slice`` and ``tpuboot wait-slice`` put together: the metadata client, one look within
the time given, and the lines people read."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from tpuboot.config import Config, MetricsConfig
from tpuboot.gce.client import MetadataClient
from tpuboot.paths import Root
from tpuboot.slice.facts import read_facts
from tpuboot.slice.sweep import STATES
from tpuboot.slice.verdict import SliceReport, look
from tpuboot.slice.wait import wait_slice
from tpuboot.wiring import metadata_settings

#: The most of a look's time the metadata server may take; the rest is the sweep's.
METADATA_SHARE = 0.5


@contextlib.contextmanager
def _quiet_metadata() -> Iterator[None]:
    """The client's "retrying" warning would be a second line beside the command's one error."""
    logger = logging.getLogger("tpuboot.gce")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class SliceLook:
    """One look at the slice within a deadline, as both commands take it."""

    def __init__(self, root: Root, config: Config, connect_timeout: float) -> None:
        self.root = root
        self.tpu_env_path = config.env.tpu_env_path
        self.client = MetadataClient.from_settings(metadata_settings(config.metadata), log_retries=False)
        self.connect_timeout = connect_timeout

    def __call__(self, deadline_s: float) -> SliceReport:
        start = time.monotonic()
        with _quiet_metadata():
            share = deadline_s * METADATA_SHARE
            facts = read_facts(self.client, self.root, self.tpu_env_path, deadline_s=share)
        left = max(self.connect_timeout, deadline_s - (time.monotonic() - start))
        return look(facts, self.root, connect_timeout=self.connect_timeout, deadline_s=left)

    def close(self) -> None:
        self.client.close()


class Remembered:
    """A looker that keeps its last report, for the metrics of the last look."""

    def __init__(self, looker: Callable[[float], SliceReport]) -> None:
        self.looker = looker
        self.last: SliceReport | None = None

    def __call__(self, deadline_s: float) -> SliceReport:
        self.last = self.looker(deadline_s)
        return self.last


def record(root: Root, config: MetricsConfig, report: SliceReport | None) -> None:
    """The look's paths by state and its FAILs to ``tpuboot-slice.prom`` when
    ``metrics.textfile_dir`` is set (prometheus_client is loaded only then)."""
    if config.textfile_dir is None or report is None:
        return
    from tpuboot.metrics_export import SliceSweep, write_slice_textfile

    paths = {state: sum(o.state == state for o in report.paths) for state in STATES}
    failures = sum(f.status == "FAIL" for f in report.findings)
    write_slice_textfile(root, config, SliceSweep(paths, failures, time.time()))


def render(report: SliceReport) -> list[str]:
    """One line per finding, the fix after a FAIL or WARN (doctor's form). What came from metadata
    is printable in every detail already (quoted by :func:`~tpuboot.errors.shown`, passed through
    :func:`~tpuboot.errors.printable`, or checked as an address or host name first), so a value
    cannot forge a line or move the terminal's cursor."""
    lines = []
    for f in report.findings:
        fix = f"  fix: {f.fix}" if f.status in ("FAIL", "WARN") and f.fix else ""
        lines.append(f"{f.status:<4}  {f.name}: {f.detail}{fix}")
    return lines


def wait(
    looker: Callable[[float], SliceReport], timeout: float, interval: float, say: Callable[[str], None]
) -> list[str]:
    """``wait-slice``: [] once the slice holds, else what is still wrong; progress through ``say``."""
    return wait_slice(
        looker, timeout, lambda wrong: say("waiting for the slice: " + "; ".join(wrong)), interval=interval
    )
