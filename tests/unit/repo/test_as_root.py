"""scripts/as-root, which scripts/setup-host, demo and test source first: root goes on as it is (a
fresh Debian 12 root has no sudo), another user's run starts again through sudo with tpuboot's
settings kept, and without sudo that user gets one line saying to run it as root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

AS_ROOT = Path(__file__).resolve().parents[3] / "scripts" / "as-root"
NOBODY = 65534
#: A sudo that records how it was asked (in the file named) and runs nothing.
FAKE_SUDO = '#!/bin/sh\nprintf "%s\\n" "$@" > {asked}\n'


@pytest.fixture
def place() -> Iterator[Path]:
    """A folder any user can reach (pytest's tmp_path is under a 0700 directory), with as-root."""
    path = Path(tempfile.mkdtemp(prefix="tpuboot-as-root-", dir="/var/tmp"))
    path.chmod(0o755)
    shutil.copy(AS_ROOT, path / "as-root")
    (path / "as-root").chmod(0o644)
    yield path
    shutil.rmtree(path)


def source(place: Path, user: int | None, path: str) -> subprocess.CompletedProcess[str]:
    """A script that sources as-root, as ``user``, with ``path`` as PATH."""
    body = f'script=/usr/local/bin/the-script; . {place}/as-root; echo "went on as $(id -u)"'
    env = {"PATH": path, "TPUBOOT_VM_CACHE": "/c", "CI": "true", "HOME": "/"}
    return subprocess.run(
        ["/bin/sh", "-c", body, "sh", "-k", "x y"],
        env=env,
        user=user,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run as root and as nobody")
def test_root_goes_on_and_another_user_starts_again_through_sudo_or_is_told(place: Path) -> None:
    assert source(place, None, "/usr/bin:/bin").stdout == "went on as 0\n"
    bin_dir = place / "bin"  # PATH: the tools as-root runs, and no other sudo than this one
    bin_dir.mkdir()
    bin_dir.chmod(0o777)  # the fake sudo, run by nobody, writes there
    for tool in ("id", "env", "sed", "sort", "paste"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or tool)
    (bin_dir / "sudo").write_text(FAKE_SUDO.format(asked=bin_dir / "asked"))
    (bin_dir / "sudo").chmod(0o755)
    done = source(place, NOBODY, str(bin_dir))
    assert (done.returncode, done.stdout) == (0, ""), done.stderr  # exec'd: nothing after ran
    asked = (bin_dir / "asked").read_text().splitlines()
    assert asked == ["--preserve-env=CI,TPUBOOT_VM_CACHE", "--", "/usr/local/bin/the-script", "-k", "x y"]
    (bin_dir / "sudo").unlink()
    done = source(place, NOBODY, str(bin_dir))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "/usr/local/bin/the-script: run it as root (it installs Debian packages and boots QEMU guests); "
        "sudo is not installed"
    ]
