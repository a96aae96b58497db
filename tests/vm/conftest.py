"""pytest integration of the real-kernel bench.

* Every test under ``tests/vm`` that uses a VM fixture carries the ``vm``
  marker (added here), so ``-m "not vm"`` leaves them out.
* A host that cannot run them (not root, qemu or another tool missing) fails
  them with one clear line, or skips them when ``TPUBOOT_SKIP_VM=1``.
* Fixtures: ``vm_bench`` (session: ``bench(platform)`` builds that platform's
  kernel, initramfs and tree at first use and makes its images), ``vm_artifacts``
  and ``vm_image_factory`` (the same for Debian 12, the default guest; the first
  build probes the accelerator meanwhile), ``vm_image`` (the bare bench image),
  ``vm_factory`` (per test: start and boot VMs, all stopped at teardown),
  ``tpuboot_images(platform)`` / ``tpuboot_image`` (the guest with the .deb).
* A failing VM test's report gets, per VM it used, the guest journal's tail and
  the console's tail.
* Each VM test's call phase is limited to ``$TPUBOOT_VM_TEST_TIMEOUT`` seconds
  (default 600) or ``@pytest.mark.vm(timeout=N)``; then it fails with
  VMTestTimeout and the VMs are cleaned up like on any failure.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from harness.vm import accel, hostenv, machine
from harness.vm.artifacts import (
    BOOKWORM,
    Artifacts,
    InstallHook,
    Kernel,
    Platform,
    build_image,
    ensure_artifacts,
    remove_tree,
)
from harness.vm.machine import VM, VMTestTimeout
from tests.conftest import VM_CALL_LIMIT_ENV, vm_call_limit

log = logging.getLogger("tpuboot.vm")

SKIP_ENV = "TPUBOOT_SKIP_VM"
HERE = Path(__file__).resolve().parent
_FIRST_SERIAL = pytest.StashKey[int]()


class ImageFactory(Protocol):
    def __call__(self, install: InstallHook | None = None, *, key: str = "base") -> Path: ...


class PlatformBench:
    """One platform's cached artifacts and this session's images of it (one per key)."""

    def __init__(self, artifacts: Artifacts, folder: Path) -> None:
        self.artifacts = artifacts
        self.folder = folder
        self.images: dict[str, Path] = {}

    def image(self, install: InstallHook | None = None, *, key: str = "base") -> Path:
        """The image made by ``install`` on a copy of the tree; the first call per key builds it."""
        if key not in self.images:
            self.images[key] = build_image(self.artifacts, self.folder / f"{key}.ext4", install)
        return self.images[key]


class BenchFactory(Protocol):
    def __call__(self, platform: Platform) -> PlatformBench: ...


class VMFactory(Protocol):
    def __call__(
        self, image: Path | None = None, *, boot: bool = True, boot_timeout: float = 240.0, **kwargs: Any
    ) -> VM: ...


# --------------------------------------------------------------------------- marker, host check


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that boots anything needs vm_artifacts (directly or through another
    # fixture). The pure tests of the bench and the harness need no VM: tests/unit/bench, tests/unit/harness.
    for item in items:
        names = getattr(item, "fixturenames", ())
        if HERE in item.path.resolve().parents and ("vm_artifacts" in names or "vm_bench" in names):
            item.add_marker(pytest.mark.vm)


@functools.cache
def _host_problem() -> str | None:
    return hostenv.host_problem()


def _is_vm_test(item: pytest.Item) -> bool:
    return item.get_closest_marker("vm") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not _is_vm_test(item):
        return
    problem = _host_problem()
    if problem:
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"VM tests skipped ({SKIP_ENV}=1): {problem}")
        pytest.fail(f"VM tests cannot run: {problem} (set {SKIP_ENV}=1 to skip them)", pytrace=False)
    item.stash[_FIRST_SERIAL] = machine.next_serial()


# --------------------------------------------------------------------------- per-test timeout


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    if not _is_vm_test(item) or threading.current_thread() is not threading.main_thread():
        yield
        return
    limit = vm_call_limit(item)

    def expire(signum: int, frame: Any) -> None:
        raise VMTestTimeout(f"{item.nodeid} exceeded its {limit:.0f}s limit ({VM_CALL_LIMIT_ENV})")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------- failure report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and _is_vm_test(item):
        first = item.stash.get(_FIRST_SERIAL, None)
        vms = machine.vms_started_since(first) if first is not None else []
        vms += [vm for vm in machine.live_vms() if vm not in vms]
        for vm in vms:
            report.sections.append((f"guest journal ({vm.name}, last 300 lines)", vm.capture_journal(300)))
            report.sections.append((f"guest console ({vm.name}, last 80 lines)", vm.console_tail(80)))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def vm_bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchFactory]:
    """``bench(platform) -> PlatformBench``: built at first use, so a session that boots only
    Debian 12 never fetches Debian 13. The first build starts the KVM/TCG probe meanwhile.

    Images are deleted at the end of the session (they are ~1 GB each).
    """
    folder = tmp_path_factory.mktemp("vm-images")
    benches: dict[str, PlatformBench] = {}

    def start_probe(kernel: Kernel, initrd: Path) -> None:
        # Not joined: it overlaps the tree and image builds; the first VM.start waits for it.
        threading.Thread(
            target=accel.select_accel, args=(kernel.boot_image, initrd), name="accel-probe", daemon=True
        ).start()

    def bench(platform: Platform) -> PlatformBench:
        if platform.name not in benches:
            probe = start_probe if not benches else None
            artifacts = ensure_artifacts(platform=platform, on_boot_files=probe)
            benches[platform.name] = PlatformBench(artifacts, folder / platform.name)
        return benches[platform.name]

    yield bench
    remove_tree(folder)


@pytest.fixture(scope="session")
def vm_artifacts(vm_bench: BenchFactory) -> Artifacts:
    """Debian 12's kernel, initramfs and guest tree (cached)."""
    return vm_bench(BOOKWORM).artifacts


@pytest.fixture(scope="session")
def vm_image_factory(vm_bench: BenchFactory) -> ImageFactory:
    """``make(install=None, *, key="base") -> Path``: one Debian 12 image per key for the session.

    ``install(tree)`` puts the software under test into a copy of the guest tree.
    """
    return vm_bench(BOOKWORM).image


@pytest.fixture(scope="session")
def vm_image(vm_image_factory: ImageFactory) -> Path:
    """The bench's image with nothing installed."""
    return vm_image_factory()


@pytest.fixture
def vm_factory(
    vm_artifacts: Artifacts, vm_image_factory: ImageFactory, request: pytest.FixtureRequest
) -> Iterator[VMFactory]:
    """``start(image=None, *, boot=True, boot_timeout=240, **VM kwargs) -> VM``.

    Starts (and by default boots) a VM for this test; all are shut down at teardown.
    """
    started: list[VM] = []

    def start(
        image: Path | None = None, *, boot: bool = True, boot_timeout: float = 240.0, **kwargs: Any
    ) -> VM:
        kwargs.setdefault("name", f"{request.node.name}-{len(started)}")
        vm = VM.from_artifacts(vm_artifacts, image or vm_image_factory(), **kwargs)
        started.append(vm)
        vm.start()
        if boot:
            vm.wait_booted(boot_timeout)
        return vm

    yield start
    errors: list[BaseException] = []
    for vm in started:
        try:
            vm.shutdown(timeout=20)
        except BaseException as exc:  # stop the others all the same
            vm.kill()
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def tpuboot_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tpuboot's .deb, built once per session from this source tree."""
    from harness.vm.tpuboot_guest import build_deb

    return build_deb(tmp_path_factory.mktemp("deb"))


class TpubootImages(Protocol):
    def __call__(self, platform: Platform = BOOKWORM) -> Path: ...


@pytest.fixture(scope="session")
def tpuboot_images(vm_bench: BenchFactory, tpuboot_deb: Path) -> TpubootImages:
    """``image(platform=BOOKWORM) -> Path``: that platform's guest with tpuboot's .deb (installed
    with apt), the stand-in device config and the metadata emulator."""
    from harness.vm.tpuboot_guest import package_install_hook

    def image(platform: Platform = BOOKWORM) -> Path:
        return vm_bench(platform).image(package_install_hook(tpuboot_deb), key="tpuboot")

    return image


@pytest.fixture(scope="session")
def tpuboot_image(tpuboot_images: TpubootImages) -> Path:
    """The Debian 12 guest with tpuboot's .deb, the stand-in device config and the emulator."""
    return tpuboot_images()
