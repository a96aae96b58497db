"""Atomic writes: idempotent, mode/owner as asked, crash-consistent, and never through a planted symlink."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.helpers.audit import audit_events
from tpuboot import atomicfile
from tpuboot.atomicfile import FileError, FileReadError, FileWriteError, open_lock, read_file, write_file
from tpuboot.paths import Root

IS_ROOT = os.geteuid() == 0


def untrusted(directory: Path) -> None:
    """Make ``directory`` writable by others, as /home/tpu-runtime is by its user."""
    directory.chmod(0o777)


def leftovers(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if ".tpuboot-" in name]


def test_creates_file_and_missing_directories_with_given_modes(root: Root) -> None:
    assert write_file(root, "/var/lib/tpuboot/cache.json", b"{}\n", mode=0o600, dir_mode=0o750)
    target = root.path("/var/lib/tpuboot/cache.json")
    assert target.read_bytes() == b"{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o750
    assert leftovers(target.parent) == []


def test_new_file_defaults_to_0644(root: Root) -> None:
    write_file(root, "/etc/environment", b"A=1\n")
    assert stat.S_IMODE(root.path("/etc/environment").stat().st_mode) == 0o644


def test_same_content_is_not_rewritten(root: Root) -> None:
    write_file(root, "/etc/environment", b"A=1\n")
    before = root.path("/etc/environment").stat()
    assert not write_file(root, "/etc/environment", b"A=1\n")
    after = root.path("/etc/environment").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_content_replaces_the_file_by_rename(root: Root) -> None:
    write_file(root, "/etc/environment", b"A=1\n")
    before = root.path("/etc/environment").stat().st_ino
    assert write_file(root, "/etc/environment", b"A=2\n")
    assert root.path("/etc/environment").read_bytes() == b"A=2\n"
    assert root.path("/etc/environment").stat().st_ino != before


def test_existing_mode_is_kept_unless_one_is_asked(root: Root) -> None:
    target = root.path("/etc/environment")
    target.write_bytes(b"old\n")
    target.chmod(0o640)
    write_file(root, "/etc/environment", b"new\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    write_file(root, "/etc/environment", b"new\n", mode=0o644)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


@pytest.mark.skipif(not IS_ROOT, reason="chown needs root")
def test_owner_is_set_and_a_wrong_owner_alone_causes_a_rewrite(root: Root) -> None:
    write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n", owner=(0, 0))
    target = root.path("/home/tpu-runtime/tpu-env")
    os.chown(target, 65534, 65534)
    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n", owner=(0, 0))
    assert (target.stat().st_uid, target.stat().st_gid) == (0, 0)


def test_read_file_returns_none_for_missing_files_and_directories(root: Root) -> None:
    assert read_file(root, "/etc/nothing") is None
    assert read_file(root, "/no/such/dir/file") is None


def test_read_file_enforces_its_limit(root: Root) -> None:
    root.path("/etc/big").write_bytes(b"x" * 100)
    assert read_file(root, "/etc/big", limit=100) == b"x" * 100
    with pytest.raises(FileReadError, match="larger than 99 bytes"):
        read_file(root, "/etc/big", limit=99)


@pytest.mark.parametrize("case", ["a directory", "a path through a file", "a link loop"])
def test_a_read_fails_with_a_read_error_never_a_write_error(root: Root, case: str) -> None:
    """Whoever reads catches FileReadError; a write's FileWriteError is another failure."""
    path = "/etc/thing"
    if case == "a directory":
        root.path(path).mkdir()
    elif case == "a path through a file":
        root.path(path).write_text("x")
        path += "/below"
    else:
        root.path("/etc/a").symlink_to("b")
        root.path("/etc/b").symlink_to("a")
        path = "/etc/a"
    with pytest.raises(FileReadError, match=f"{path}") as caught:
        read_file(root, path)
    assert isinstance(caught.value, FileError) and not isinstance(caught.value, FileWriteError)
    assert "\n" not in str(caught.value)


def test_a_directory_in_the_way_is_an_error_and_leaves_no_temp_file(root: Root) -> None:
    root.path("/etc/environment").mkdir()
    with pytest.raises(FileWriteError, match="cannot write /etc/environment"):
        write_file(root, "/etc/environment", b"A=1\n")
    assert leftovers(root.path("/etc")) == []


# --- symlink attacks: the directory is writable by an unprivileged user ---------------------


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file the attacker wants root to overwrite (stands for /etc/shadow)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    return victim


def test_symlink_planted_as_the_target_is_replaced_not_followed(root: Root, outside: Path) -> None:
    home = root.path("/home/tpu-runtime")
    untrusted(home)
    (home / "tpu-env").symlink_to(outside)
    assert write_file(root, "/home/tpu-runtime/tpu-env", b'A="1"\n')
    assert outside.read_bytes() == b"precious\n"
    assert not (home / "tpu-env").is_symlink()
    assert (home / "tpu-env").read_bytes() == b'A="1"\n'


def test_symlink_planted_at_the_temp_name_is_never_opened(
    root: Root, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = root.path("/home/tpu-runtime")
    untrusted(home)
    names = iter(["deadbeef", "deadbeef", "cafef00d"])
    monkeypatch.setattr(atomicfile.secrets, "token_hex", lambda _n: next(names))
    (home / ".tpu-env.tpuboot-deadbeef").symlink_to(outside)
    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n")
    assert outside.read_bytes() == b"precious\n"
    assert (home / "tpu-env").read_bytes() == b"A=1\n"
    assert (home / ".tpu-env.tpuboot-deadbeef").is_symlink()


def test_symlink_planted_as_an_intermediate_directory_is_refused(root: Root, tmp_path: Path) -> None:
    home = root.path("/home/tpu-runtime")
    untrusted(home)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (home / "conf").symlink_to(elsewhere)
    with pytest.raises(FileWriteError, match="conf is a symbolic link in a directory others can write"):
        write_file(root, "/home/tpu-runtime/conf/tpu-env", b"A=1\n")
    assert os.listdir(elsewhere) == []


@pytest.mark.skipif(not IS_ROOT, reason="needs a directory owned by another user")
def test_directory_owned_by_another_user_is_untrusted(root: Root, outside: Path) -> None:
    home = root.path("/home/tpu-runtime")
    os.chown(home, 65534, 65534)
    (home / "sub").symlink_to(outside.parent)
    with pytest.raises(FileWriteError, match="refusing to follow"):
        write_file(root, "/home/tpu-runtime/sub/victim", b"owned\n")
    assert outside.read_bytes() == b"precious\n"


def test_read_refuses_a_symlink_in_an_untrusted_directory(root: Root, outside: Path) -> None:
    home = root.path("/home/tpu-runtime")
    untrusted(home)
    (home / "tpu-env").symlink_to(outside)
    with pytest.raises(FileReadError, match="refusing to follow"):
        read_file(root, "/home/tpu-runtime/tpu-env")


def test_symlink_in_a_trusted_directory_is_followed_under_the_root(root: Root) -> None:
    """Only root could have made it (e.g. a distribution's /etc link): write where it points, in the Root."""
    root.path("/etc/default").mkdir()
    root.path("/etc/environment").symlink_to("/etc/default/environment")
    assert write_file(root, "/etc/environment", b"A=1\n")
    assert root.path("/etc/environment", follow=False).is_symlink()
    assert root.path("/etc/default/environment").read_bytes() == b"A=1\n"
    assert read_file(root, "/etc/environment") == b"A=1\n"


def test_a_lock_file_is_opened_as_a_write_walks_inside_the_root(root: Root, outside: Path) -> None:
    """Created 0600 with its directories; an image's absolute link resolves inside the image; a
    link planted in a directory others can write is refused, and what it names is untouched."""
    os.close(open_lock(root, "/var/lib/tpuboot/resets.lock"))
    made = root.path("/var/lib/tpuboot/resets.lock")
    assert made.is_file() and stat.S_IMODE(made.stat().st_mode) == 0o600
    root.path("/run").mkdir()
    root.path("/run/lock").symlink_to("/var/lib/tpuboot")  # absolute: the image's own /var
    os.close(open_lock(root, "/run/lock/other.lock"))
    assert root.path("/var/lib/tpuboot/other.lock").is_file()
    home = root.path("/home/tpu-runtime")
    untrusted(home)
    (home / "x.lock").symlink_to(outside)
    with pytest.raises(FileWriteError, match=r"cannot open /home/tpu-runtime/x\.lock: it is a symbolic link"):
        open_lock(root, "/home/tpu-runtime/x.lock")
    assert outside.read_bytes() == b"precious\n"


def test_dotdot_cannot_climb_out_of_the_root(root: Root, tmp_path: Path) -> None:
    write_file(root, "/../../etc/escaped", b"x\n")
    assert root.path("/etc/escaped").read_bytes() == b"x\n"
    assert not (tmp_path / "etc").exists()


def test_symlink_loop_is_an_error(root: Root) -> None:
    root.path("/etc/a").symlink_to("b")
    root.path("/etc/b").symlink_to("a")
    with pytest.raises(
        FileWriteError, match=r"^/etc/a: more than 40 symbolic links, a loop through /etc/[ab]; remove"
    ):
        write_file(root, "/etc/a", b"x\n")


# --- crash consistency -----------------------------------------------------------------------


# Python 3.12 warns at a fork with other threads running (pytest-xdist's): a lock another thread
# held stays held in the child. This child only calls write_file (no logging, no lazy import, no
# lock) and _exit, and a fork is what lets 200 writers be killed mid-write in a second or two.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_kill_at_random_moments_leaves_old_or_new_content(root: Root) -> None:
    """kill -9 a writer 200 times mid-rewrite: the file is always exactly one whole version."""
    versions = [bytes([65 + i]) * (256 * 1024) + b"\n" for i in range(2)]
    path = "/home/tpu-runtime/tpu-env"
    write_file(root, path, versions[0])
    rng = random.Random(1234)
    for trial in range(200):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: alternate between the versions until killed
            try:
                os.close(ready_r)
                os.write(ready_w, b"go")
                i = trial
                while True:
                    i += 1
                    write_file(root, path, versions[i % 2])
            finally:
                os._exit(0)
        os.close(ready_w)
        os.read(ready_r, 2)
        os.close(ready_r)
        time.sleep(rng.uniform(0, 0.004))  # the kill lands at a random point of some write
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert root.path(path).read_bytes() in versions, f"torn file after kill {trial}"


def test_the_next_write_removes_temp_files_a_crash_left_but_nothing_else(root: Root) -> None:
    path = "/home/tpu-runtime/tpu-env"
    write_file(root, path, b"A=1\n")
    here = root.path(path).parent
    stale, fresh = here / ".tpu-env.tpuboot-0123abcd", here / ".tpu-env.tpuboot-89abcdef"
    for temp in (stale, fresh):
        temp.write_bytes(b"half")
    old = time.time() - atomicfile.STALE_TEMP_S - 5
    os.utime(stale, (old, old))
    others = [here / ".tpu-env.tpuboot-0123abcdef", here / ".other.tpuboot-0123abcd", here / "notes"]
    for other in others:
        other.write_bytes(b"keep")
        os.utime(other, (old, old))
    link = here / ".tpu-env.tpuboot-deadbeef"
    link.symlink_to(here / "notes")
    os.utime(link, (old, old), follow_symlinks=False)

    assert not write_file(root, path, b"A=1\n")  # unchanged: no write, no sweep
    assert stale.exists()
    assert write_file(root, path, b"A=2\n")
    assert not stale.exists()  # a crash's leftover, a minute old
    assert fresh.exists()  # may be another writer's, in flight
    assert all(other.read_bytes() == b"keep" for other in others) and link.is_symlink()


# --- a directory owned by the runtime user (its home), the writer root ----------------------


@pytest.mark.skipif(not IS_ROOT, reason="needs a directory owned by another user")
def test_users_0700_home_gets_a_root_0644_file_never_written_through(root: Root, outside: Path) -> None:
    home = root.path("/home/tpu-runtime")
    os.chown(home, 65534, 65534)
    home.chmod(0o700)
    (home / "tpu-env").symlink_to(outside)
    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n", mode=0o644, owner=(0, 0))
    st = (home / "tpu-env").lstat()
    assert (stat.S_ISREG(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid) == (True, 0o644, 0)
    assert outside.read_bytes() == b"precious\n"
    assert (stat.S_IMODE(home.stat().st_mode), home.stat().st_uid) == (0o700, 65534)  # left as it was


def test_a_directory_at_the_name_is_one_line_naming_the_fix(root: Root) -> None:
    (root.path("/home/tpu-runtime/tpu-env") / "sub").mkdir(parents=True)
    with pytest.raises(FileWriteError) as caught:
        write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n")
    assert str(caught.value) == "cannot write /home/tpu-runtime/tpu-env: a directory is in the way; remove it"
    assert leftovers(root.path("/home/tpu-runtime")) == []


def test_a_failing_sweep_does_not_fail_a_write_that_is_done(root: Root) -> None:
    swept: list[str] = []

    def refuse(parent: int, name: str) -> None:
        swept.append(name)
        raise PermissionError(13, "Permission denied")

    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n", sweep=refuse)
    assert swept == ["tpu-env"]
    assert root.path("/home/tpu-runtime/tpu-env").read_bytes() == b"A=1\n"


def test_the_sweep_streams_a_directory_without_listing_it_whole(root: Root) -> None:
    """os.scandir, one name at a time; never os.listdir, a list of all of a user's (maybe millions
    of) names. Watched through the interpreter's audit events, which both raise."""
    home = root.path("/home/tpu-runtime")
    for i in range(200):
        (home / f"junk{i}").write_bytes(b"")
    with audit_events() as events:
        assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n")
    listed = [name for name, _ in events if name in ("os.listdir", "os.scandir")]
    assert listed == ["os.scandir"]
    assert len(os.listdir(home)) == 201


@pytest.mark.skipif(not IS_ROOT or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_without_cap_dac_override_a_users_home_is_a_one_line_error_naming_it(root: Root) -> None:
    """What tpuboot.service did before it had CAP_DAC_OVERRIDE: root, a 0700 home not its own."""
    home = root.path("/home/tpu-runtime")
    os.chown(home, 65534, 65534)
    home.chmod(0o700)
    code = (
        "import sys\nfrom tpuboot.atomicfile import write_file, FileWriteError\n"
        "from tpuboot.paths import Root\n"
        "try: write_file(Root(sys.argv[1]), '/home/tpu-runtime/tpu-env', b'A=1\\n')\n"
        "except FileWriteError as exc: print(exc)\n"
    )
    argv = [
        "setpriv",
        "--bounding-set=-dac_override,-dac_read_search",
        sys.executable,
        "-c",
        code,
        str(root.prefix),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == (
        "cannot write /home/tpu-runtime/tpu-env: permission denied; a directory on its path is not root's "
        "and this process lacks CAP_DAC_OVERRIDE (tpuboot.service has it: keep it in CapabilityBoundingSet=)"
    )
    assert list(home.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="needs a directory owned by another user")
def test_a_fifo_or_hard_link_the_user_plants_is_replaced_not_opened_for_writing(root: Root) -> None:
    """A FIFO would block an open for reading; a hard link of the user's own file would be
    truncated by an open for writing. Neither is written through: the name is replaced."""
    home = root.path("/home/tpu-runtime")
    os.chown(home, 65534, 65534)
    os.mkfifo(home / "tpu-env")
    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=1\n", mode=0o644, owner=(0, 0))
    mine = home / "mine"
    mine.write_bytes(b"mine\n")
    os.chown(mine, 65534, 65534)
    (home / "tpu-env").unlink()
    os.link(mine, home / "tpu-env")
    assert write_file(root, "/home/tpu-runtime/tpu-env", b"A=2\n", mode=0o644, owner=(0, 0))
    assert mine.read_bytes() == b"mine\n"
    assert (home / "tpu-env").read_bytes() == b"A=2\n" and (home / "tpu-env").stat().st_uid == 0


def unit_capabilities() -> list[str]:
    """tpuboot.service's CapabilityBoundingSet=, as setpriv names them (sys_module, ...)."""
    unit = (Path(__file__).parents[2] / "systemd/tpuboot.service").read_text()
    (line,) = [x for x in unit.splitlines() if x.startswith("CapabilityBoundingSet=")]
    return [cap.removeprefix("CAP_").lower() for cap in line.partition("=")[2].split()]


@pytest.mark.skipif(not IS_ROOT or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("home_mode", [0o700, 0o750, 0o2770], ids=oct)
def test_the_units_capabilities_write_tpu_env_into_a_users_home(
    root: Root, outside: Path, home_mode: int
) -> None:
    """With exactly the unit's capability set: a user's home of the usual modes (0700: adduser,
    0750: Ubuntu's useradd; setgid: a new file's group is the directory's, fchown gives root's
    back without CAP_CHOWN) gets a root 0644 file, and a planted link is replaced."""
    home = root.path("/home/tpu-runtime")
    os.chown(home, 65534, 65534)
    home.chmod(home_mode)
    (home / "tpu-env").symlink_to(outside)
    code = (
        "import sys\nfrom tpuboot.atomicfile import write_file\nfrom tpuboot.paths import Root\n"
        "write_file(Root(sys.argv[1]), '/home/tpu-runtime/tpu-env', b'A=1\\n', mode=0o644, owner=(0, 0))\n"
    )
    bounding = ",".join(["-all", *(f"+{cap}" for cap in unit_capabilities())])
    argv = ["setpriv", f"--bounding-set={bounding}", sys.executable, "-c", code, str(root.prefix)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    st = (home / "tpu-env").lstat()
    assert (stat.S_ISREG(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (True, 0o644, 0, 0)
    assert (home / "tpu-env").read_bytes() == b"A=1\n"
    assert outside.read_bytes() == b"precious\n"
