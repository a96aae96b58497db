"""The image build paths, for real (issue 13, item 6): Debian's cloud-init with a NoCloud seed
installs the .deb and runs ``tpuboot prepare-image`` on a build VM; the same disk then boots as a
TPU VM.
"""

from __future__ import annotations

import os
from pathlib import Path

from .artifacts import CHROOT_ENV, _building, _digest, _source, _timed, remove_tree, run
from . import hostenv

CLOUD_INIT_PACKAGES = ("cloud-init",)


def _install_cloud_init(tmp: Path, tree: Path) -> None:
    run(["cp", "-a", "--reflink=auto", tree, tmp], timeout=600)
    proc = tmp / "proc"
    resolv = tmp / "etc/resolv.conf"
    resolv.write_bytes(Path("/etc/resolv.conf").read_bytes())  # the guest's own is empty (no network)
    run(["mount", "-t", "proc", "proc", proc], timeout=30)
    try:
        env = {**CHROOT_ENV}
        run(["chroot", tmp, "apt-get", "update", "-q"], timeout=600, env=env)
        run(
            ["chroot", tmp, "apt-get", "install", "-y", "-q", "--no-install-recommends", *CLOUD_INIT_PACKAGES],
            timeout=900,
            env=env,
        )
        run(["chroot", tmp, "apt-get", "clean"], timeout=60, env=env)
    finally:
        run(["umount", "-l", proc], timeout=30)
        resolv.write_text("")
    for lists in (tmp / "var/lib/apt/lists").glob("*_dists_*"):
        lists.unlink()


def ensure_cloudinit_tree(tree: Path, cache: Path | None = None) -> Path:
    """The bench's Debian 12 tree with Debian's cloud-init installed by apt (cached by the tree's key).

    debootstrap --include=cloud-init fails in its unordered base configuration step
    (python3-cryptography), so cloud-init goes in afterwards with apt, in a chroot.
    """
    parent = (cache or hostenv.cache_dir()) / "cloudinit"
    final = parent / f"{tree.name}-{_digest(repr(CLOUD_INIT_PACKAGES), _source(_install_cloud_init))}"
    if not final.is_dir():
        parent.mkdir(parents=True, exist_ok=True)
        for old in parent.iterdir():
            if old != final and not old.name.startswith("."):
                remove_tree(old)
        with _timed("guest tree with cloud-init"), _building(final) as tmp:
            _install_cloud_init(tmp, tree)
    return final
