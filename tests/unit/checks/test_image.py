"""tpuboot.checks.image against temporary trees: each check passes, fails and skips where it should."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.unit.helpers.images import GOOD_CMDLINE, MANAGER_GOOD, PAM_GOOD, Answering, NoSystemctl, write
from tpuboot import verdicts
from tpuboot.checks.image import run_checks
from tpuboot.checks.parsers.rlimits import UNLIMITED, Limit
from tpuboot.checks.parsers.systemd import Systemd, parse_rlimit
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult, Checks, Criterion

DOCKER_UNIT = "[Unit]\nDescription=Docker\n\n[Service]\nExecStart=/usr/bin/dockerd\nLimitNPROC=infinity\n"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return tmp_path


def mask(tree: Path, path: str) -> None:
    real = tree / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.symlink_to("/dev/null")


def result(tree: Path, name: str, systemd: Systemd | None = None) -> CheckResult:
    (found,) = [r for r in run_checks(Root(tree), systemd=systemd or NoSystemctl()) if r.name == name]
    return found


# --- Kernel command line -------------------------------------------------------------------------


def running(tree: Path, cmdline: str, arch: str = "x86_64") -> None:
    write(tree, "/proc/cmdline", cmdline)
    write(tree, "/proc/sys/kernel/arch", arch + "\n")


CMDLINE_CHECKS = ("cmdline-idle-poll", "cmdline-transparent-hugepage", "cmdline-intel-iommu")


def test_cmdline_with_every_parameter_passes(tree):
    running(tree, GOOD_CMDLINE)
    assert [result(tree, name).status for name in CMDLINE_CHECKS] == ["PASS"] * 3


def test_cmdline_without_them_fails_with_a_fix(tree):
    running(tree, "BOOT_IMAGE=/vmlinuz root=UUID=1 ro quiet\n")
    for name in CMDLINE_CHECKS:
        found = result(tree, name)
        assert found.status == "FAIL"
        assert "update-grub" in found.fix and "reboot" in found.fix
    assert "no idle=" in result(tree, "cmdline-idle-poll").detail


def test_cmdline_fix_points_at_the_installed_grub_dropin(tree):
    running(tree, "ro transparent_hugepage=madvise\n")
    write(tree, "/etc/default/grub.d/tpuboot.cfg", "")
    found = result(tree, "cmdline-transparent-hugepage")
    assert found.detail == (
        "kernel command line lacks transparent_hugepage=always (transparent_hugepage=madvise)"
    )
    assert found.fix.startswith("/etc/default/grub.d/tpuboot.cfg adds transparent_hugepage=always")


@pytest.mark.parametrize(
    ("cmdline", "status"),
    [
        ("idle=poll", "PASS"),
        ("idle=halt", "FAIL"),
        ("idle=poll idle=nomwait", "FAIL"),  # the last one wins
        ("idle=halt idle=poll", "PASS"),
        ('dyndbg="file x.c +p" idle=poll', "PASS"),  # a quoted value with spaces is one word
        ("noidle=poll", "FAIL"),
    ],
)
def test_idle_poll_reads_the_last_value(tree, cmdline, status):
    running(tree, cmdline)
    assert result(tree, "cmdline-idle-poll").status == status


@pytest.mark.parametrize(
    ("cmdline", "status"),
    [
        ("intel_iommu=on,sm_on", "PASS"),
        ("intel_iommu=sm_on,on", "PASS"),
        ("intel_iommu=on intel_iommu=sm_on", "PASS"),  # options accumulate
        ("intel_iommu=on", "FAIL"),
        ("intel_iommu=on,sm_on intel_iommu=off", "FAIL"),
        ("intel_iommu=on,sm_on,sm_off", "FAIL"),
        ("amd_iommu=on", "FAIL"),
    ],
)
def test_intel_iommu_needs_on_and_scalable_mode(tree, cmdline, status):
    running(tree, cmdline)
    assert result(tree, "cmdline-intel-iommu").status == status


def test_intel_iommu_is_skipped_off_x86(tree):
    running(tree, "idle=poll", arch="aarch64")
    found = result(tree, "cmdline-intel-iommu")
    assert (found.status, found.detail) == ("SKIP", "not needed on aarch64")


def test_cmdline_checks_skip_on_a_tree_that_is_not_running(tree):
    write(tree, "/proc/sys/kernel/arch", "x86_64\n")
    assert {result(tree, name).status for name in CMDLINE_CHECKS} == {"SKIP"}


# --- Transparent huge pages ----------------------------------------------------------------------

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("[always] madvise never\n", "PASS"),
        ("always [madvise] never\n", "FAIL"),
        ("always madvise [never]\n", "FAIL"),
    ],
)
def test_thp_reads_the_selected_mode(tree, text, status):
    write(tree, THP, text)
    found = result(tree, "thp-enabled")
    assert found.status == status
    assert bool(found.fix) == (status == "FAIL")


def test_thp_is_skipped_without_sysfs(tree):
    assert result(tree, "thp-enabled").status == "SKIP"


# --- PAM limits ----------------------------------------------------------------------------------


def test_pam_limits_in_limits_d_pass(tree):
    write(tree, "/etc/security/limits.d/tpuboot.conf", PAM_GOOD)
    for name in ("pam-memlock", "pam-nofile"):
        found = result(tree, name)
        assert found.status == "PASS", found
    assert "(/etc/security/limits.d/tpuboot.conf)" in result(tree, "pam-memlock").detail


def test_pam_limits_unset_fail(tree):
    found = result(tree, "pam-memlock")
    assert found.status == "FAIL"
    assert found.detail == "PAM memlock: * not set; root not set; need unlimited for both"
    assert "/etc/security/limits.d/tpuboot.conf" in found.fix


def test_pam_star_does_not_cover_root(tree):
    write(tree, "/etc/security/limits.conf", "* - memlock unlimited\n* - nofile 100000\n")
    found = result(tree, "pam-memlock")
    assert found.status == "FAIL"
    assert "root not set" in found.detail


def test_pam_soft_and_hard_both_count(tree):
    write(tree, "/etc/security/limits.d/a.conf", "* hard memlock unlimited\nroot hard memlock unlimited\n")
    assert result(tree, "pam-memlock").status == "FAIL"  # the soft limit stays the default
    write(tree, "/etc/security/limits.d/b.conf", "* soft memlock unlimited\nroot soft memlock -1\n")
    assert result(tree, "pam-memlock").status == "PASS"


def test_pam_later_file_wins_and_a_name_beats_star(tree):
    write(tree, "/etc/security/limits.conf", PAM_GOOD)
    write(tree, "/etc/security/limits.d/90-low.conf", "* - nofile 1024\n")
    found = result(tree, "pam-nofile")
    assert found.status == "FAIL"
    assert "* 1024 (/etc/security/limits.d/90-low.conf)" in found.detail
    # root's own entry (in the earlier file) still beats the later "*", which never applies to root.
    assert "root 100000 (/etc/security/limits.conf)" in found.detail
    write(tree, "/etc/security/limits.d/95-me.conf", "alice - nofile 1024\n* - nofile 200000\n")
    assert result(tree, "pam-nofile").status == "PASS"


def test_pam_ignores_comments_groups_and_malformed_lines(tree):
    write(
        tree,
        "/etc/security/limits.d/x.conf",
        "# * - memlock 64\n@tpu - memlock 64\n* - memlock\n* - memlock lots\n"
        "* - memlock unlimited # inline comment\nroot - memlock unlimited\n",
    )
    assert result(tree, "pam-memlock").status == "PASS"


def test_pam_nofile_unlimited_is_enough(tree):
    write(tree, "/etc/security/limits.d/x.conf", "* - nofile unlimited\nroot - nofile infinity\n")
    assert result(tree, "pam-nofile").status == "PASS"


# --- systemd manager defaults --------------------------------------------------------------------

MANAGER_DROPIN = "/usr/lib/systemd/system.conf.d/50-tpuboot.conf"


def test_manager_dropin_passes(tree):
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)
    found = result(tree, "systemd-default-limits")
    assert found.status == "PASS", found
    assert found.detail == (
        f"systemd defaults: memlock unlimited ({MANAGER_DROPIN}), nofile 100000 ({MANAGER_DROPIN})"
    )


def test_manager_defaults_unset_fail(tree):
    write(tree, "/etc/systemd/system.conf", "[Manager]\n#DefaultLimitMEMLOCK=\n")
    found = result(tree, "systemd-default-limits")
    assert found.status == "FAIL"
    assert "systemd's built-in default" in found.detail
    assert MANAGER_DROPIN in found.fix


def test_manager_dropin_masked_in_etc_fails(tree):
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)
    mask(tree, "/etc/systemd/system.conf.d/50-tpuboot.conf")
    assert result(tree, "systemd-default-limits").status == "FAIL"


def test_manager_later_dropin_overrides_and_empty_resets(tree):
    write(tree, "/etc/systemd/system.conf", MANAGER_GOOD)  # read first, so drop-ins override it
    write(tree, "/etc/systemd/system.conf.d/90-local.conf", "[Manager]\nDefaultLimitNOFILE=1024:524288\n")
    found = result(tree, "systemd-default-limits")
    assert "nofile 1024:524288 (/etc/systemd/system.conf.d/90-local.conf)" in found.detail
    assert found.status == "FAIL"
    write(tree, "/etc/systemd/system.conf.d/90-local.conf", "[Manager]\nDefaultLimitMEMLOCK=\n")
    found = result(tree, "systemd-default-limits")
    assert "memlock systemd's built-in default" in found.detail


def test_manager_settings_outside_manager_section_are_ignored(tree):
    write(tree, MANAGER_DROPIN, "[Service]\nDefaultLimitMEMLOCK=infinity\nDefaultLimitNOFILE=100000\n")
    assert result(tree, "systemd-default-limits").status == "FAIL"


@pytest.mark.parametrize(
    ("text", "soft", "hard"),
    [
        ("infinity", UNLIMITED, UNLIMITED),
        ("64M", 64 << 20, 64 << 20),
        ("8K:infinity", 8192, UNLIMITED),
        ("1024:524288", 1024, 524288),
        ("100000", 100000, 100000),
    ],
)
def test_parse_rlimit(text, soft, hard):
    assert parse_rlimit(text, "x") == Limit(soft, hard, "x")


@pytest.mark.parametrize("text", ["lots", "-1", "1:2:3", ""])
def test_parse_rlimit_refuses_junk(text):
    with pytest.raises(ValueError):
        parse_rlimit(text, "x")


def test_unreadable_limit_fails_and_says_where(tree):
    write(tree, MANAGER_DROPIN, "[Manager]\nDefaultLimitMEMLOCK=lots\nDefaultLimitNOFILE=100000\n")
    found = result(tree, "systemd-default-limits")
    assert found.status == "FAIL"
    assert f"'lots' in {MANAGER_DROPIN} is unreadable" in found.detail


# --- Container runtimes --------------------------------------------------------------------------

RUNTIMES = [("docker-limits", "docker.service"), ("containerd-limits", "containerd.service")]


@pytest.mark.parametrize(("name", "unit"), RUNTIMES)
def test_runtime_not_installed_is_skipped(tree, name, unit):
    write(tree, f"/usr/lib/systemd/system/{unit}.d/50-tpuboot.conf", "[Service]\nLimitMEMLOCK=infinity\n")
    found = result(tree, name)
    assert (found.status, found.detail) == ("SKIP", f"{unit} is not installed")


@pytest.mark.parametrize(("name", "unit"), RUNTIMES)
def test_runtime_dropin_passes(tree, name, unit):
    write(tree, f"/lib/systemd/system/{unit}", DOCKER_UNIT)
    write(tree, f"/usr/lib/systemd/system/{unit}.d/50-tpuboot.conf", "[Service]\nLimitMEMLOCK=infinity\n")
    write(tree, f"/usr/lib/systemd/system/{unit}.d/60-more.conf", "[Service]\nLimitNOFILE=200000\n")
    found = result(tree, name)
    assert found.status == "PASS", found


@pytest.mark.parametrize(("name", "unit"), RUNTIMES)
def test_runtime_without_limits_fails(tree, name, unit):
    write(tree, f"/lib/systemd/system/{unit}", DOCKER_UNIT)
    found = result(tree, name)
    assert found.status == "FAIL"
    assert f"/etc/systemd/system/{unit}.d/" in found.fix and f"restart {unit}" in found.fix


def test_runtime_falls_back_to_the_manager_defaults(tree):
    write(tree, "/lib/systemd/system/docker.service", DOCKER_UNIT)
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)
    found = result(tree, "docker-limits")
    assert found.status == "PASS"
    assert f"memlock unlimited (default: {MANAGER_DROPIN})" in found.detail


def test_runtime_unit_setting_beats_manager_default(tree):
    write(tree, "/lib/systemd/system/docker.service", DOCKER_UNIT + "LimitMEMLOCK=64M\n")
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)
    found = result(tree, "docker-limits")
    assert found.status == "FAIL"
    assert "memlock 67108864 (/lib/systemd/system/docker.service)" in found.detail


def test_runtime_admin_dropin_sorted_later_wins(tree):
    write(tree, "/lib/systemd/system/docker.service", DOCKER_UNIT)
    write(
        tree, "/usr/lib/systemd/system/docker.service.d/50-tpuboot.conf", "[Service]\nLimitMEMLOCK=infinity\n"
    )
    write(tree, "/etc/systemd/system/docker.service.d/90-local.conf", "[Service]\nLimitMEMLOCK=8M\n")
    assert result(tree, "docker-limits").status == "FAIL"
    mask(tree, "/etc/systemd/system/docker.service.d/40-unused.conf")  # masking a name nobody ships
    write(tree, "/etc/systemd/system/docker.service.d/90-local.conf", "[Service]\nLimitNOFILE=100000\n")
    assert result(tree, "docker-limits").status == "PASS"


def test_runtime_dropin_for_every_service_applies(tree):
    write(tree, "/lib/systemd/system/containerd.service", DOCKER_UNIT)
    write(
        tree,
        "/etc/systemd/system/service.d/10-limits.conf",
        "[Service]\nLimitMEMLOCK=infinity\nLimitNOFILE=100000\n",
    )
    assert result(tree, "containerd-limits").status == "PASS"


def test_runtime_masked_or_aliased_unit(tree):
    write(
        tree,
        "/lib/systemd/system/docker.service",
        DOCKER_UNIT + "LimitMEMLOCK=infinity\nLimitNOFILE=100000\n",
    )
    alias = tree / "etc/systemd/system/docker.service"
    alias.parent.mkdir(parents=True)
    alias.symlink_to("/lib/systemd/system/docker.service")  # absolute: read under the root
    assert result(tree, "docker-limits").status == "PASS"
    alias.unlink()
    alias.symlink_to("/dev/null")
    assert result(tree, "docker-limits").status == "SKIP"


def test_live_systemd_is_asked_where_it_runs(tree):
    answers: dict[str | None, dict[str, str]] = {
        None: {
            "DefaultLimitMEMLOCK": "infinity",
            "DefaultLimitMEMLOCKSoft": "infinity",
            "DefaultLimitNOFILE": "524288",
            "DefaultLimitNOFILESoft": "1024",
        },
        "docker.service": {
            "LoadState": "loaded",
            "LimitMEMLOCK": "infinity",
            "LimitMEMLOCKSoft": "infinity",
            "LimitNOFILE": "100000",
            "LimitNOFILESoft": "100000",
        },
    }

    systemd = Answering(answers)
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)  # on disk but not in force: systemctl's answer wins
    manager = result(tree, "systemd-default-limits", systemd)
    assert manager.status == "FAIL"
    assert "nofile 1024:524288 (systemctl show)" in manager.detail
    assert result(tree, "docker-limits", systemd).status == "PASS"
    assert result(tree, "containerd-limits", systemd).status == "SKIP"
    assert {None, "docker.service", "containerd.service"} <= set(systemd.asked)


def test_files_are_read_when_systemctl_cannot_answer(tree):
    write(tree, MANAGER_DROPIN, MANAGER_GOOD)
    systemd = Answering(None)
    assert result(tree, "systemd-default-limits", systemd).status == "PASS"
    assert systemd.asked


def test_systemctl_show_output_is_parsed(tmp_path, monkeypatch):
    fake = tmp_path / "systemctl"
    fake.write_text('#!/bin/sh\necho "$*" > "$0.args"\nprintf "LoadState=loaded\\nLimitNOFILE=100000\\n"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert Systemd().show("docker.service", ["LoadState", "LimitNOFILE"]) == {
        "LoadState": "loaded",
        "LimitNOFILE": "100000",
    }
    args = (tmp_path / "systemctl.args").read_text().split()
    assert args == ["show", "--property=LoadState", "--property=LimitNOFILE", "docker.service"]
    fake.write_text("#!/bin/sh\necho 'System has not been booted with systemd' >&2\nexit 1\n")
    assert Systemd().show(None, ["DefaultLimitNOFILE"]) is None


def test_host_root_without_systemd_reads_files():
    assert Systemd().live(Root("/")) == os.path.isdir("/run/systemd/system")
    assert not Systemd().live(Root("/tmp"))


# --- udev ----------------------------------------------------------------------------------------

ACCEL_RULE = 'KERNEL=="accel*", MODE="0666"\n'


def test_accel_rule_passes(tree):
    write(tree, "/lib/udev/rules.d/70-tpuboot.rules", "# comment\n" + ACCEL_RULE)
    found = result(tree, "accel-udev-rule")
    assert (found.status, found.detail) == (
        "PASS",
        "/lib/udev/rules.d/70-tpuboot.rules gives accel* mode 0666",
    )


def test_accel_rule_missing_fails(tree):
    write(tree, "/etc/udev/rules.d/99-other.rules", 'KERNEL=="vfio", MODE="0666"\n')
    found = result(tree, "accel-udev-rule")
    assert found.status == "FAIL"
    assert 'KERNEL=="accel*", MODE="0666"' in found.fix


@pytest.mark.parametrize(
    ("rule", "status"),
    [
        ('KERNEL=="accel[0-9]*", MODE:="0666"', "PASS"),
        ('SUBSYSTEM=="accel", KERNEL=="accel*", MODE="0666", GROUP="render"', "PASS"),
        ('KERNEL=="accel*|apex*", \\\n  MODE="0666"', "PASS"),  # alternatives, continued line
        ('KERNEL=="accel*", MODE="0660"', "FAIL"),
        ('KERNEL=="accel*", MODE="0666", MODE="0600"', "FAIL"),
        ('ACTION=="remove", KERNEL=="accel*", MODE="0666"', "FAIL"),
        ('KERNEL!="accel*", MODE="0666"', "FAIL"),
        ('# KERNEL=="accel*", MODE="0666"', "FAIL"),
    ],
)
def test_accel_rule_forms(tree, rule, status):
    write(tree, "/etc/udev/rules.d/70-tpu.rules", rule + "\n")
    assert result(tree, "accel-udev-rule").status == status


def test_accel_rule_overridden_by_etc_fails(tree):
    write(tree, "/lib/udev/rules.d/70-tpuboot.rules", ACCEL_RULE)
    mask(tree, "/etc/udev/rules.d/70-tpuboot.rules")
    assert result(tree, "accel-udev-rule").status == "FAIL"
    (tree / "etc/udev/rules.d/70-tpuboot.rules").unlink()
    write(tree, "/etc/udev/rules.d/70-tpuboot.rules", "# emptied by the admin\n")
    assert result(tree, "accel-udev-rule").status == "FAIL"


# --- The registry --------------------------------------------------------------------------------


def test_empty_tree(tree):
    statuses = {r.name: r.status for r in run_checks(Root(tree))}
    assert statuses == {
        "cmdline-idle-poll": "SKIP",
        "cmdline-transparent-hugepage": "SKIP",
        "cmdline-intel-iommu": "SKIP",
        "vfio-pci-in-kernel": "SKIP",
        "thp-enabled": "SKIP",
        "pam-memlock": "FAIL",
        "pam-nofile": "FAIL",
        "systemd-default-limits": "FAIL",
        "docker-limits": "SKIP",
        "containerd-limits": "SKIP",
        "accel-udev-rule": "FAIL",
        # No leftover of the documented procedure where there is nothing (checks/test_leftovers.py).
        "leftover-vfio-binder": "PASS",
        "leftover-accel-rule": "SKIP",
        "leftover-tpu-env-writer": "PASS",
        "leftover-environment-appender": "PASS",
        "leftover-metadata-script": "PASS",
        "leftover-limits-conf": "SKIP",
        "leftover-grub-cmdline": "PASS",
        "leftover-environment-duplicates": "PASS",
    }


def test_every_fail_has_a_one_line_fix_and_nothing_else_does(tree):
    running(tree, "ro")
    write(tree, THP, "always [madvise] never\n")
    write(tree, "/lib/systemd/system/docker.service", DOCKER_UNIT)
    for r in run_checks(Root(tree)):
        assert bool(r.fix) == (r.status in ("FAIL", "WARN")), r
        assert "\n" not in r.fix and "\n" not in r.detail


def test_results_are_frozen_and_serialisable():
    r = CheckResult("x", "PASS", "fine")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.status = "FAIL"  # type: ignore[misc]
    assert r.as_dict() == {"name": "x", "status": "PASS", "detail": "fine", "fix": ""}


def test_registry_names_results_and_isolates_a_failing_check(tree):
    def first(root: Root) -> CheckResult:
        return verdicts.passed("ok")

    def broken(root: Root) -> CheckResult:
        return verdicts.passed(root.path("/etc/secret").read_text())

    def last(root: Root) -> CheckResult:
        return verdicts.skipped("n/a")

    named = {name: Criterion(name, f"the {name} check") for name in ("first", "broken", "last")}
    checks = Checks([(named["first"], first), (named["broken"], broken), (named["last"], last)])
    results = checks.run(Root(tree))
    assert [(r.name, r.status) for r in results] == [("first", "PASS"), ("broken", "FAIL"), ("last", "SKIP")]
    assert results[1].detail.startswith("cannot read: ")
    assert checks.names == ["first", "broken", "last"]
    with pytest.raises(ValueError, match="registered twice"):
        Checks([(named["first"], first), (named["last"], last), (Criterion("first", "again"), first)])


# --- vfio-pci in the kernel -------------------------------------------------------------------

UBUNTU_BUILTIN = "kernel/drivers/vfio/vfio.ko\nkernel/drivers/vfio/vfio_iommu_type1.ko\n" + (
    "kernel/drivers/vfio/pci/vfio-pci-core.ko\nkernel/drivers/vfio/pci/vfio-pci.ko\n"
)
DEBIAN_DEP = (
    "kernel/drivers/vfio/pci/vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz "
    "kernel/drivers/vfio/vfio.ko.xz kernel/virt/lib/irqbypass.ko.xz\n"
    "kernel/drivers/net/virtio_net.ko.xz: kernel/drivers/net/net_failover.ko.xz\n"
)


def kernel_lists(
    tree: Path, release: str, builtin: str = "", dep: str = "", modinfo: str | None = None
) -> None:
    write(tree, f"/lib/modules/{release}/modules.builtin", builtin)
    write(tree, f"/lib/modules/{release}/modules.dep", dep)
    if modinfo is not None:
        write(tree, f"/lib/modules/{release}/modules.builtin.modinfo", modinfo)


def test_vfio_pci_built_into_an_ubuntu_image_kernel_passes(tree):
    kernel_lists(
        tree, "6.8.0-1015-gcp", builtin=UBUNTU_BUILTIN, dep="kernel/drivers/net/virtio_net.ko.zst:\n"
    )
    found = result(tree, "vfio-pci-in-kernel")
    assert found.status == "PASS"
    assert found.detail == "vfio-pci built into 6.8.0-1015-gcp (/lib/modules/6.8.0-1015-gcp/modules.builtin)"


def test_vfio_pci_as_a_compressed_module_of_a_debian_image_kernel_passes(tree):
    kernel_lists(tree, "6.12.48+deb13-cloud-amd64", dep=DEBIAN_DEP)
    found = result(tree, "vfio-pci-in-kernel")
    assert (found.status, found.detail) == (
        "PASS",
        "vfio-pci a module of 6.12.48+deb13-cloud-amd64 (/lib/modules/6.12.48+deb13-cloud-amd64/modules.dep)",
    )


def test_modules_builtin_modinfo_alone_is_evidence(tree):
    write(tree, "/lib/modules/6.8.0-49-generic/modules.dep", "")
    write(
        tree,
        "/lib/modules/6.8.0-49-generic/modules.builtin.modinfo",
        "vfio_pci.license=GPL v2\0vfio.license=GPL\0",
    )
    assert "modules.builtin.modinfo" in result(tree, "vfio-pci-in-kernel").detail


def test_an_image_kernel_without_vfio_pci_fails_and_names_it(tree):
    kernel_lists(tree, "6.8.0-1015-gcp", builtin=UBUNTU_BUILTIN)
    kernel_lists(
        tree,
        "6.1.0-9-rt-amd64",
        builtin="kernel/drivers/virtio/virtio_pci.ko\n",
        dep="kernel/drivers/net/virtio_net.ko:\n",
    )
    found = result(tree, "vfio-pci-in-kernel")
    assert found.status == "FAIL"
    assert found.detail == "no vfio-pci in 6.1.0-9-rt-amd64, neither built in nor as a module"
    assert "CONFIG_VFIO_PCI" in found.fix


@pytest.mark.parametrize(("shape", "status", "start"), [
    ("builtin", "PASS", "vfio-pci built into 6.8.0-1015-gcp"),
    ("module", "PASS", "vfio-pci a module of 6.1.0-28-cloud-amd64"),
    ("none", "FAIL", "no vfio-pci in 6.1.0-28-cloud-amd64"),
])  # fmt: skip
def test_a_running_kernel_is_judged_by_its_own_release(tmp_path, shape, status, start):
    from tests.unit.fakes.kernel import FakeKernel

    kernel = FakeKernel(tmp_path, shape)
    kernel_lists(tmp_path, "9.9.9-other", builtin="")  # another installed kernel does not count
    found = result(tmp_path, "vfio-pci-in-kernel")
    assert (found.status, found.detail.startswith(start)) == (status, True), found
    assert kernel.release in found.detail


def test_no_module_lists_is_skip(tree):
    (tree / "lib/modules/6.8.0-1015-gcp").mkdir(parents=True)
    assert result(tree, "vfio-pci-in-kernel").status == "SKIP"


def test_a_merged_usr_image_is_read_through_its_lib_link(tree):
    """Ubuntu and Debian images: /lib -> usr/lib, the kernel's lists under /usr/lib/modules."""
    write(tree, "/usr/lib/modules/6.8.0-1015-gcp/modules.builtin", UBUNTU_BUILTIN)
    (tree / "lib").symlink_to("usr/lib")
    assert result(tree, "vfio-pci-in-kernel").detail.startswith("vfio-pci built into 6.8.0-1015-gcp")
