"""The next boot's kernel command line, read from the GRUB defaults without running them.

Benign files are checked against sh itself (what grub-mkconfig does: source them in order);
hostile or unusual ones must be refused with the file and line, and nothing in them may run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tpuboot.checks.image import run_checks
from tpuboot.checks.parsers.grub import TPUBOOT_FUNCTION, Unreadable, grub_files, next_boot
from tpuboot.paths import Root

REPO = Path(__file__).resolve().parents[3]
SHIPPED_DROPIN = (REPO / "conf/grub.d/tpuboot.cfg").read_text()

# Debian 12's /etc/default/grub (a command substitution in GRUB_DISTRIBUTOR).
DEBIAN_GRUB = """# If you change this file, run 'update-grub' afterwards to update
GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX=""
#GRUB_TERMINAL=console
"""
# Ubuntu cloud images' drop-in: overwrites DEFAULT.
CLOUDIMG = """# Cloud Image specific Grub settings for Generic Cloud Images
GRUB_RECORDFAIL_TIMEOUT=0
GRUB_TIMEOUT=0
GRUB_CMDLINE_LINUX_DEFAULT="console=tty1 console=ttyS0"
GRUB_TERMINAL=console
"""


def tree(tmp_path: Path, grub: str | None, dropins: dict[str, str] | None = None) -> Root:
    if grub is not None:
        (tmp_path / "etc/default").mkdir(parents=True, exist_ok=True)
        (tmp_path / "etc/default/grub").write_text(grub)
    for name, text in (dropins or {}).items():
        (tmp_path / "etc/default/grub.d").mkdir(parents=True, exist_ok=True)
        (tmp_path / "etc/default/grub.d" / name).write_text(text)
    return Root(tmp_path)


def sourced(root: Root) -> tuple[str, str]:
    """What sh makes of the same files, sourced in grub-mkconfig's order (benign files only)."""
    files = " ".join(f'. "{root.path(f)}";' for f in grub_files(root))
    script = f'{files} printf "%s\\0%s" "$GRUB_CMDLINE_LINUX" "$GRUB_CMDLINE_LINUX_DEFAULT"'
    out = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}
    )
    linux, default = out.stdout.split("\0")
    return linux, default


def words(root: Root, arch: str = "amd64") -> str:
    boot = next_boot(root, arch)
    assert boot is not None
    return " ".join(boot.words)


def test_the_shipped_dropin_is_read_by_its_known_text() -> None:
    assert TPUBOOT_FUNCTION in SHIPPED_DROPIN
    assert 'case "$(dpkg --print-architecture 2>/dev/null || uname -m)" in\n' in SHIPPED_DROPIN


@pytest.mark.parametrize(
    ("grub", "dropins"),
    [
        (DEBIAN_GRUB, {"tpuboot.cfg": SHIPPED_DROPIN}),
        (DEBIAN_GRUB, {"50-cloudimg-settings.cfg": CLOUDIMG, "tpuboot.cfg": SHIPPED_DROPIN}),
        # An explicit choice wins over the drop-in: it adds nothing for idle.
        (DEBIAN_GRUB.replace('LINUX=""', 'LINUX="idle=halt"'), {"tpuboot.cfg": SHIPPED_DROPIN}),
        # The "append in grub.d" way, with every quoting form.
        (
            DEBIAN_GRUB,
            {
                "10-a.cfg": 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX intel_iommu=on"\n',
                "20-b.cfg": "export GRUB_CMDLINE_LINUX_DEFAULT=\"${GRUB_CMDLINE_LINUX_DEFAULT} a='x y'\"\n",
                "30-c.cfg": "X=1 GRUB_CMDLINE_LINUX=$GRUB_CMDLINE_LINUX' b=\"q\"'\\ c; Y=2 # note\n",
                "40-d.cfg": 'GRUB_CMDLINE_LINUX="$GRUB_CMDLINE_LINUX \\\n  d=\\$e"\n',
                "tpuboot.cfg": SHIPPED_DROPIN,
            },
        ),
        # The shipped drop-in sourced twice adds nothing the second time.
        (DEBIAN_GRUB, {"tpuboot.cfg": SHIPPED_DROPIN, "zz-again.cfg": SHIPPED_DROPIN}),
        ("GRUB_CMDLINE_LINUX=\"console=ttyS0,115200 root='LABEL=x y'\"\n", {}),
    ],
)
def test_benign_files_read_as_sh_sources_them(tmp_path: Path, grub: str, dropins: dict[str, str]) -> None:
    root = tree(tmp_path, grub, dropins)
    boot = next_boot(root, "amd64")
    assert boot is not None and (boot.linux, boot.default) == sourced(root)


def test_the_dropin_adds_the_iommu_only_for_x86(tmp_path: Path) -> None:
    root = tree(tmp_path, DEBIAN_GRUB, {"tpuboot.cfg": SHIPPED_DROPIN})
    assert words(root, "amd64") == "idle=poll transparent_hugepage=always intel_iommu=on,sm_on quiet"
    assert words(root, "arm64") == "idle=poll transparent_hugepage=always quiet"


def test_an_edited_dropin_is_read_as_edited(tmp_path: Path) -> None:
    edited = SHIPPED_DROPIN.replace("tpuboot_cmdline_add idle=poll\n", "# tpuboot_cmdline_add idle=poll\n")
    root = tree(tmp_path, DEBIAN_GRUB, {"tpuboot.cfg": edited})
    assert words(root) == "transparent_hugepage=always intel_iommu=on,sm_on quiet"


def test_no_grub_configuration_is_none(tmp_path: Path) -> None:
    assert next_boot(Root(tmp_path), "amd64") is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("rm -rf /\n", "'rm' is a command"),
        ('GRUB_CMDLINE_LINUX="$(touch {canary})"\n', "not known without running shell"),
        ("GRUB_CMDLINE_LINUX=`touch {canary}`\n", "not known without running shell"),
        ("GRUB_CMDLINE_LINUX=x; touch {canary}\n", "'touch' is a command"),
        ("GRUB_CMDLINE_LINUX=x && touch {canary}\n", "more than assignments"),
        ("GRUB_CMDLINE_LINUX=x&&touch {canary}\n", "outside quotes"),
        ("GRUB_CMDLINE_LINUX=x > {canary}\n", "more than assignments"),
        ("GRUB_CMDLINE_LINUX=x>{canary}\n", "outside quotes"),
        (". /etc/default/other\n", "is a command"),
        ('eval "GRUB_CMDLINE_LINUX=x"\n', "'eval' is a command"),
        ('if true; then GRUB_CMDLINE_LINUX="idle=poll"; fi\n', "'if' is a command"),
        ('GRUB_CMDLINE_LINUX="${X:-idle=poll}"\n', "more than a plain variable"),
        ('GRUB_CMDLINE_LINUX="idle=poll\n', 'unterminated "'),
        ("f() { :; }\n", "is a command"),
        ("tpuboot_cmdline_add idle=poll\n", "without its definition"),
    ],
)
def test_hostile_or_unusual_files_are_refused_and_nothing_runs(tmp_path: Path, text: str, why: str) -> None:
    canary = tmp_path / "ran"
    root = tree(tmp_path / "t", DEBIAN_GRUB, {"50-odd.cfg": text.replace("{canary}", str(canary))})
    with pytest.raises(Unreadable) as info:
        next_boot(root, "amd64")
    assert why in str(info.value)
    assert "/etc/default/grub.d/50-odd.cfg line 1" in str(info.value)
    assert not canary.exists()


def test_an_unknown_value_is_harmless_until_the_command_line_uses_it(tmp_path: Path) -> None:
    root = tree(tmp_path, DEBIAN_GRUB + 'GRUB_CMDLINE_LINUX="$GRUB_DISTRIBUTOR"\n')
    why = r"GRUB_CMDLINE_LINUX is not known without running shell \(/etc/default/grub line 4\)"
    with pytest.raises(Unreadable, match=why):
        next_boot(root, "amd64")


def test_image_check_on_a_tree_judges_its_next_boot(tmp_path: Path) -> None:
    root = tree(tmp_path, DEBIAN_GRUB, {"tpuboot.cfg": SHIPPED_DROPIN})
    (tmp_path / "var/lib/dpkg").mkdir(parents=True)
    (tmp_path / "var/lib/dpkg/arch").write_text("amd64\n")
    results = {r.name: r for r in run_checks(root, ["cmdline-*"])}
    assert {r.status for r in results.values()} == {"PASS"}
    assert results["cmdline-idle-poll"].detail == "next boot's command line (update-grub) has idle=poll"


def test_image_check_names_a_wrong_value_set_before_the_dropin(tmp_path: Path) -> None:
    grub = DEBIAN_GRUB.replace('LINUX=""', 'LINUX="transparent_hugepage=madvise"')
    root = tree(tmp_path, grub, {"tpuboot.cfg": SHIPPED_DROPIN})
    result = run_checks(root, ["cmdline-transparent-hugepage"])[0]
    assert result.status == "FAIL"
    assert "lacks transparent_hugepage=always (transparent_hugepage=madvise)" in result.detail


def test_image_check_warns_when_it_cannot_tell(tmp_path: Path) -> None:
    root = tree(tmp_path, DEBIAN_GRUB, {"50-odd.cfg": "if true; then :; fi\n"})
    result = run_checks(root, ["cmdline-idle-poll"])[0]
    assert result.status == "WARN"
    assert "50-odd.cfg line 1" in result.detail


def test_a_running_system_is_judged_on_proc_cmdline_unless_next_boot(tmp_path: Path) -> None:
    root = tree(tmp_path, DEBIAN_GRUB, {"tpuboot.cfg": SHIPPED_DROPIN})
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("root=/dev/vda ro quiet\n")
    assert run_checks(root, ["cmdline-idle-poll"])[0].status == "FAIL"
    ahead = run_checks(root, ["cmdline-idle-poll"], next_boot=True)[0]
    assert ahead.status == "PASS" and ahead.detail.startswith("next boot's")
