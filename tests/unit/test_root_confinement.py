"""--root as a chroot: hostile image trees whose links lead out, and roots that are not usable.

Each tree sits beside a "host" directory standing for the build machine's own files (canaries):
whatever the image's links say, nothing there may be read, written, removed, printed or cached.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.audit import audit_events
from tpuboot import atomicfile, cli
from tpuboot.atomicfile import read_file, remove_file, write_file
from tpuboot.checks.doctor import Doctor
from tpuboot.checks.image import run_checks
from tpuboot.config import Config, ConfigError, load_config
from tpuboot.env.sync import EnvSync
from tpuboot.paths import MAX_SYMLINK_HOPS, LinkLoopError, Root, RootError
from tpuboot.prepare import Preparer

SECRET = "root:$y$j9T$SECRET-HASH:19000:0:99999:7:::"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """The build host's files that an image's links name: a shadow file, an /etc with tpuboot's
    files, a runtime directory, a home."""
    top = tmp_path / "host"
    for path, text in {
        "etc/shadow": SECRET + "\n",
        "etc/tpuboot/tpuboot.yaml": "vfio: {retries: 9}  # the host's own\n",
        "var/lib/tpuboot/tpu-env.json": "{}\n",
        "etc/default/grub.d/90-host.cfg": 'GRUB_CMDLINE_LINUX="idle=poll"\n',
        "run/tpuboot/tpu-env.env": "HOST=1\n",
        "home/tpu-runtime/tpu-env": 'HOST="1"\n',
    }.items():
        (top / path).parent.mkdir(parents=True, exist_ok=True)
        (top / path).write_text(text)
    return top


def snapshot(top: Path) -> dict[str, bytes | str]:
    """Every entry under ``top``: a file's bytes, a link's target, a directory's mark."""
    out: dict[str, bytes | str] = {}
    for base, dirs, files in os.walk(top):
        for name in dirs + files:
            path = Path(base, name)
            key = str(path.relative_to(top))
            out[key] = (
                os.readlink(path) if path.is_symlink() else ("dir" if path.is_dir() else path.read_bytes())
            )
    return out


@pytest.fixture
def image(tmp_path: Path) -> Path:
    top = tmp_path / "image"
    (top / "etc/tpuboot").mkdir(parents=True)
    return top


def link(image: Path, path: str, target: str | Path) -> None:
    where = image / path.lstrip("/")
    where.parent.mkdir(parents=True, exist_ok=True)
    where.symlink_to(target)


# --- Root.path: a chroot's resolution --------------------------------------------------------------


@pytest.mark.parametrize(
    ("links", "asked", "lands"),
    [
        ({"/run": "/etc"}, "/run/tpuboot/x", "/etc/tpuboot/x"),  # absolute: from the root again
        ({"/run": "../../../../../../../../etc"}, "/run/x", "/etc/x"),  # .. stops at the root
        ({"/a": "b/../../../../etc/c"}, "/a", "/etc/c"),
        ({"/etc/x": "../../../../shadow"}, "/etc/x", "/shadow"),
        ({"/lib": "usr/lib"}, "/lib/udev/s", "/usr/lib/udev/s"),  # a merged /usr
        ({"/etc/x": "y", "/etc/y": "/etc/z"}, "/etc/x", "/etc/z"),  # a chain
        ({"/home": "/"}, "/home/../../../etc/shadow", "/etc/shadow"),
    ],
)
def test_every_link_resolves_inside_the_root(
    image: Path, host: Path, links: dict[str, str], asked: str, lands: str
) -> None:
    for path, target in links.items():
        link(image, path, target.replace("HOST", str(host)))
    root = Root(image)
    real = root.path(asked)  # as given where the kernel gets the same file, else resolved
    assert Path(os.path.realpath(real)) == image / lands.lstrip("/")
    assert root.resolve(asked) == lands


def test_a_link_to_a_host_path_is_that_path_in_the_image(image: Path, host: Path) -> None:
    link(image, "/etc/tpuboot/tpuboot.yaml", host / "etc/shadow")
    real = Root(image).path("/etc/tpuboot/tpuboot.yaml")
    assert real == image / str(host / "etc/shadow").lstrip("/")
    assert not real.exists()


def test_follow_false_keeps_the_last_link_and_resolves_the_rest(image: Path) -> None:
    link(image, "/run", "/etc")
    link(image, "/etc/tpuboot/a", "/nowhere")
    assert Root(image).path("/run/tpuboot/a", follow=False) == image / "etc/tpuboot/a"


@pytest.mark.parametrize("loop", [{"/etc/a": "a"}, {"/etc/a": "b", "/etc/b": "/etc/a"}, {"/x": "/x/y"}])
def test_a_link_loop_is_one_error_not_a_hang_or_a_traceback(image: Path, loop: dict[str, str]) -> None:
    for path, target in loop.items():
        link(image, path, target)
    asked = next(iter(loop))
    with pytest.raises(
        LinkLoopError, match=rf"^{asked} under .*: more than {MAX_SYMLINK_HOPS} symbolic links"
    ):
        Root(image).path(asked)
    with pytest.raises(OSError):  # what every handler of a failed open already catches
        Root(image).path(asked)


def test_forty_links_are_followed_and_forty_one_refused(image: Path) -> None:
    for i in range(MAX_SYMLINK_HOPS):
        link(image, f"/l{i}", f"/l{i + 1}")
    (image / f"l{MAX_SYMLINK_HOPS}").write_text("end")
    assert Root(image).path("/l0").read_text() == "end"
    link(image, "/before", "/l0")
    with pytest.raises(LinkLoopError):
        Root(image).path("/before")


def test_the_host_root_is_unchanged(tmp_path: Path) -> None:
    assert Root("/").path("/run/x") == Path("/run/x")
    assert Root().is_host


# --- roots that are not usable ---------------------------------------------------------------------


def test_an_empty_root_is_a_usage_error_never_the_host(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["--root", "", "image-check"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tpuboot: --root is empty; give the image's directory, or leave it out for this host (/)"]
    monkeypatch.setenv("TPUBOOT_ROOT", "")
    assert cli.main(["prepare-image"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        "tpuboot: $TPUBOOT_ROOT is empty; give the image's directory, or leave it out for this host (/)"
    )
    with pytest.raises(RootError):
        Root("")


@pytest.mark.parametrize("kind", ["loop", "self", "file", "missing", "dangling"])
def test_a_root_that_is_not_a_directory_gets_one_line(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    given = tmp_path / "r"
    if kind == "loop":
        (tmp_path / "a").symlink_to(tmp_path / "r")
        given.symlink_to(tmp_path / "a")
    elif kind == "self":
        given.symlink_to(given)
    elif kind == "file":
        given.write_text("")
    elif kind == "dangling":
        given.symlink_to(tmp_path / "gone")
    for argv in (["image-check"], ["doctor"], ["prepare-image"], ["status"]):
        assert cli.main(["--root", str(given), *argv]) == cli.EXIT_USAGE
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("tpuboot: ") and "give the image's directory" in line, line


# --- the configuration and its cache ---------------------------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "relative", "through-dir", "dotdot"])
def test_an_image_config_linked_to_a_host_file_never_reads_it(image: Path, host: Path, how: str) -> None:
    before = snapshot(host)
    if how == "absolute":
        link(image, "/etc/tpuboot/tpuboot.yaml", host / "etc/shadow")
    elif how == "relative":
        link(image, "/etc/tpuboot/tpuboot.yaml", "../" * 12 + str(host / "etc/shadow").lstrip("/"))
    elif how == "through-dir":
        shutil.rmtree(image / "etc")
        link(image, "/etc", host / "etc")
    else:
        link(image, "/etc/tpuboot/tpuboot.yaml", "../../../host/etc/shadow")  # image/../host
    try:
        config = load_config(Root(image))
    except ConfigError as exc:
        assert SECRET not in str(exc) and "SECRET" not in str(exc)
    else:
        assert config == Config()  # no such file in the image: the defaults, never the host's
    assert not [
        p for p in image.rglob("*") if not p.is_symlink() and p.is_file() and "SECRET" in p.read_text()
    ]
    assert snapshot(host) == before


def test_an_image_config_link_inside_the_image_is_followed_there(image: Path, host: Path) -> None:
    (image / "etc/tpuboot/real.yaml").write_text("vfio: {retries: 7}\n")
    link(image, "/etc/tpuboot/tpuboot.yaml", "/etc/tpuboot/real.yaml")
    assert load_config(Root(image)).vfio.retries == 7


def test_a_config_link_loop_is_one_line_from_every_command(
    image: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link(image, "/etc/tpuboot/tpuboot.yaml", "tpuboot.yaml")
    assert cli.main(["--root", str(image), "image-check"]) == cli.EXIT_FAILED  # reads no configuration
    capsys.readouterr()
    for argv in (["doctor"], ["prepare-image"], ["env"]):
        code = cli.main(["--root", str(image), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code in (cli.EXIT_FAILED, cli.EXIT_USAGE) and len(err) == 1, err
        assert "symbolic links" in err[0]


# --- prepare-image ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "links",
    [
        {"/run": "HOST/etc"},
        {"/run": "HOST/run"},
        {"/run/tpuboot": "HOST/run/tpuboot"},
        {"/run": "../../../../../../../../../../HOST/run"},
        {"/home": "HOST/home", "/var": "HOST/var"},
        {"/home/tpu-runtime/tpu-env": "HOST/home/tpu-runtime/tpu-env"},
        {"/var/lib/tpuboot": "HOST/var/lib/tpuboot"},
        {"/var": "HOST/var", "/run/tpuboot": "../../../../HOST/run/tpuboot"},
    ],
)
def test_prepare_image_removes_nothing_outside_the_image(
    image: Path, host: Path, links: dict[str, str]
) -> None:
    for path, target in links.items():
        link(image, path, target.replace("HOST", str(host)).replace("/" + str(host).lstrip("/"), str(host)))
    before = snapshot(host)
    results = {r.name: r for r in Preparer(Root(image), Config()).run()}
    assert snapshot(host) == before
    assert results["instance-state"].status in ("PASS", "FAIL")


def test_prepare_image_empties_the_runtime_dir_only_when_no_link_leads_there(image: Path) -> None:
    (image / "etc/tpuboot/keep.yaml").write_text("x")
    link(image, "/run", "/etc")  # in a chroot, /run/tpuboot would be the image's /etc/tpuboot
    result = {r.name: r for r in Preparer(Root(image), Config()).run()}["instance-state"]
    assert result.status == "FAIL" and result.detail.startswith("/run is a symbolic link")
    assert (image / "etc/tpuboot/keep.yaml").exists()
    (image / "run").unlink()
    (image / "run/tpuboot").mkdir(parents=True)
    (image / "run/tpuboot/tpu-env.env").write_text("A=1\n")
    result = {r.name: r for r in Preparer(Root(image), Config()).run()}["instance-state"]
    assert result.status == "PASS" and "/run/tpuboot/tpu-env.env" in result.detail


def test_a_directory_swapped_for_a_link_after_the_walk_is_still_the_one_removed_from(
    image: Path, host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (image / "home/tpu-runtime").mkdir(parents=True)
    (image / "home/tpu-runtime/tpu-env").write_text("A=1\n")
    real = atomicfile._resolve

    def swap_after_walk(*args: object, **kwargs: object) -> tuple[int, str]:
        found = real(*args, **kwargs)  # type: ignore[arg-type]
        os.rename(image / "home/tpu-runtime", image / "home/moved")
        (image / "home/tpu-runtime").symlink_to(host / "home/tpu-runtime")
        return found

    monkeypatch.setattr(atomicfile, "_resolve", swap_after_walk)
    assert remove_file(Root(image), "/home/tpu-runtime/tpu-env")
    assert (host / "home/tpu-runtime/tpu-env").read_text() == 'HOST="1"\n'
    assert not (image / "home/moved/tpu-env").exists()  # removed where the walk found it


# --- env writes, GRUB drop-ins, doctor ---------------------------------------------------------------


def test_env_files_are_written_inside_the_image(image: Path, host: Path) -> None:
    link(image, "/run", host / "run")
    link(image, "/home", "../host/home")  # to the host, were the kernel to follow it
    before = snapshot(host)
    root = Root(image)
    assert write_file(root, "/run/tpuboot/tpu-env.env", b"A=1\n")
    assert write_file(root, "/home/tpu-runtime/tpu-env", b'A="1"\n')
    assert read_file(root, "/home/tpu-runtime/tpu-env") == b'A="1"\n'
    assert snapshot(host) == before
    assert (image / "host/home/tpu-runtime/tpu-env").read_bytes() == b'A="1"\n'  # .. stopped at the root


def test_env_print_reads_the_images_file_not_the_hosts(
    image: Path, host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (image / "home/tpu-runtime").mkdir(parents=True)
    link(image, "/home/tpu-runtime/tpu-env", host / "etc/shadow")
    assert EnvSync  # the sync writes through atomicfile; the print reads back what was written
    cli.main(["--root", str(image), "--config", "/nonexistent", "env", "--print"])
    assert "SECRET" not in capsys.readouterr().out


@pytest.mark.parametrize("target", ["/etc/default/extra.cfg", "../extra.cfg"])
def test_a_linked_grub_dropin_is_read_where_the_image_has_it(image: Path, host: Path, target: str) -> None:
    (image / "etc/default/grub.d").mkdir(parents=True)
    (image / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX="quiet"\n')
    (image / "etc/default/extra.cfg").write_text('GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX idle=poll"\n')
    link(image, "/etc/default/grub.d/50-extra.cfg", target)
    assert run_checks(Root(image), ["cmdline-idle-poll"], next_boot=True)[0].status == "PASS"


def test_a_grub_dropin_linked_to_the_host_is_not_the_hosts(image: Path, host: Path) -> None:
    (image / "etc/default/grub.d").mkdir(parents=True)
    (image / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX="quiet"\n')
    link(image, "/etc/default/grub.d/50-host.cfg", host / "etc/default/grub.d/90-host.cfg")
    assert run_checks(Root(image), ["cmdline-idle-poll"], next_boot=True)[0].status == "FAIL"


def test_doctor_on_a_hostile_image_reads_nothing_of_the_host(image: Path, host: Path) -> None:
    kernel = FakeKernel(image)
    link(image, "/etc/tpuboot/tpuboot.yaml", host / "etc/shadow")
    link(image, "/home", host / "home")
    link(image, "/etc/environment", host / "etc/shadow")
    before = snapshot(host)
    verdicts = Doctor(kernel.root, Config()).run()
    shown = "\n".join(f"{v.result.detail} {v.result.fix}" for v in verdicts)
    assert "SECRET" not in shown
    assert not [
        p
        for p in image.rglob("*")
        if not p.is_symlink() and p.is_file() and "SECRET" in p.read_text(errors="replace")
    ]
    assert snapshot(host) == before


@pytest.mark.parametrize("how", ["file", "directory", "relative"])
def test_image_check_judges_the_image_not_the_host_its_links_name(image: Path, host: Path, how: str) -> None:
    """The host has the documented binder rule and script; the image only links to them."""
    from tests.unit.helpers.images import BIND_SCRIPT, VFIO_RULES

    (host / "etc/udev/rules.d").mkdir(parents=True)
    (host / "etc/udev/rules.d/99-tpu-vfiopci.rules").write_text(VFIO_RULES)
    (host / "lib/udev").mkdir(parents=True)
    (host / "lib/udev/bind_to_vfio_pci.sh").write_text(BIND_SCRIPT)
    clean = {r.name: r.status for r in run_checks(Root(image), ["leftover-*"])}
    if how == "file":
        link(image, "/etc/udev/rules.d/99-tpu-vfiopci.rules", host / "etc/udev/rules.d/99-tpu-vfiopci.rules")
        link(image, "/lib/udev/bind_to_vfio_pci.sh", host / "lib/udev/bind_to_vfio_pci.sh")
    elif how == "directory":
        link(image, "/etc/udev", host / "etc/udev")
        link(image, "/lib", host / "lib")
    else:
        link(image, "/etc/udev", "../" * 8 + str(host / "etc/udev").lstrip("/"))
    before = snapshot(host)
    assert {r.name: r.status for r in run_checks(Root(image), ["leftover-*"])} == clean
    assert snapshot(host) == before


# --- every command, every kind of access -----------------------------------------------------------

#: The tops an image tree links to the host in the test below (the host's canaries are beneath).
LINKED_TOPS = ("home", "run", "var", "lib", "usr", "boot", "proc", "sys", "dev")
ACCESSES = (
    "open",
    "os.listdir",
    "os.scandir",
    "os.remove",
    "os.rename",
    "os.mkdir",
    "os.chmod",
    "shutil.rmtree",
)


@pytest.mark.parametrize("relative", [False, True], ids=["absolute-links", "relative-links"])
def test_no_command_on_a_linked_image_touches_a_host_path(
    image: Path, host: Path, relative: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command that takes --root, on a tree whose config, GRUB files, /etc/environment and
    top directories all link to the host: no file or directory under the host is opened, listed,
    made, changed or removed (the audit hook sees every access, each path taken where the kernel
    would take it), and nothing of it is printed."""
    for top in LINKED_TOPS:
        (host / top).mkdir(exist_ok=True)
        (host / top / "canary").write_text(SECRET + "\n")
    (image / "etc/default/grub.d").mkdir(parents=True)
    targets = {f"/{top}": host / top for top in LINKED_TOPS} | {
        "/etc/tpuboot/tpuboot.yaml": host / "etc/shadow",
        "/etc/environment": host / "etc/shadow",
        "/etc/default/grub": host / "etc/shadow",
        "/etc/default/grub.d/90-host.cfg": host / "etc/default/grub.d/90-host.cfg",
    }
    for path, target in targets.items():
        link(image, path, "../" * 12 + str(target).lstrip("/") if relative else target)
    before = snapshot(host)
    with audit_events() as seen:
        for argv in (
            ["image-check"],
            ["image-check", "--json"],
            ["prepare-image"],
            ["doctor"],
            ["status"],
            ["who"],
            ["cdi"],
            ["release"],
            ["wait-free", "--timeout", "0.1"],
            ["bind", "0000:00:04.0"],
            ["reset", "--dry-run", "0000:00:04.0"],
        ):
            cli.main(["--root", str(image), *argv])
    touched = {
        (event, os.fsdecode(args[0]))
        for event, args in seen
        if event in ACCESSES and args and isinstance(args[0], (str, bytes, os.PathLike))
    }
    # Where the kernel would take each path (a relative one is a name under a directory fd the
    # atomic writer's walk opened, itself among these):
    landed = [(event, path, os.path.realpath(path)) for event, path in touched if path.startswith("/")]
    assert [t for t in landed if t[2].startswith(str(host))] == []
    # The hook saw the config link followed inside the image, where a chroot would find it:
    assert any(path == f"{image}{host}/etc/shadow" for event, path in touched if event == "open")
    shown = capsys.readouterr()
    assert "SECRET" not in shown.out + shown.err
    assert snapshot(host) == before
