"""The documented procedure's leftovers (imagecheck's ``leftover-*`` checks) on temporary trees.

Each kind: found (with the file named and its fix), not found, tpuboot's own files not flagged,
and a similar but harmless file not flagged. The procedure's files are taken from bench/baseline
(re-created from the documented procedure) where it has them, else written as the procedure
writes them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.helpers.images import BASELINE, BIND_SCRIPT, REPO, VFIO_RULES
from tpuboot import cli
from tpuboot.checks.doctor import Doctor
from tpuboot.checks.image import run_checks
from tpuboot.config import Config
from tpuboot.paths import Root
from tpuboot.verdicts import CheckResult

TPUBOOT_RULE = (REPO / "udev/tpuboot.rules").read_text()
ENV_VARS_SCRIPT = (BASELINE / "configure-env-vars.sh").read_text()
GCS_SCRIPT = "".join(
    f'echo "{line}" >> /etc/environment\n'
    for line in (
        "GCS_RESOLVE_REFRESH_SECS=60",
        "GCS_REQUEST_CONNECTION_TIMEOUT_SECS=300",
        "GCS_METADATA_REQUEST_TIMEOUT_SECS=300",
        "GCS_READ_REQUEST_TIMEOUT_SECS=300",
        "GCS_WRITE_REQUEST_TIMEOUT_SECS=600",
    )
)
GET_VM_METADATA = """\
import sys, requests, os

key = sys.argv[1]
request = requests.get("http://metadata.google.internal/computeMetadata/v1/instance/{}/{}".format(
    'attributes', key), headers={'Metadata-Flavor': 'Google'})
if request.status_code == 200:
  print(request.content)
"""
# The procedure's cloud-config, as an image builder would bake it into /etc/cloud/cloud.cfg.d.
CLOUD_CONFIG = (
    "#cloud-config\nwrite_files:\n - path: /var/scripts/configure-env-vars.sh\n"
    "   permissions: 0444\n   owner: root\n   content: |\n"
    + "".join(f"     {line}\n" for line in ENV_VARS_SCRIPT.splitlines())
    + "runcmd:\n - bash /var/scripts/configure-env-vars.sh\n"
)
DOCUMENTED_LIMITS = """\
*  hard  memlock  unlimited
*  soft  memlock  unlimited
*    soft    nofile       100000
*    hard    nofile       100000
root soft    nofile       100000
root hard    nofile       100000
"""


def write(tree: Path, path: str, text: str) -> Path:
    real = tree / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.write_text(text)
    return real


def check(tree: Path, name: str) -> CheckResult:
    (found,) = run_checks(Root(tree), [name])
    return found


# --- A second vfio binder -------------------------------------------------------------------------


def test_documented_udev_rule_is_a_second_binder(tmp_path):
    write(tmp_path, "/etc/udev/rules.d/99-tpu-vfiopci.rules", VFIO_RULES)
    write(tmp_path, "/lib/udev/bind_to_vfio_pci.sh", BIND_SCRIPT)
    write(tmp_path, "/lib/udev/rules.d/70-tpuboot.rules", TPUBOOT_RULE)
    found = check(tmp_path, "leftover-vfio-binder")
    assert found.status == "FAIL"
    assert "/etc/udev/rules.d/99-tpu-vfiopci.rules (/lib/udev/bind_to_vfio_pci.sh)" in found.detail
    assert found.fix == (
        "remove /etc/udev/rules.d/99-tpu-vfiopci.rules (and /lib/udev/bind_to_vfio_pci.sh): "
        "tpuboot binds TPUs itself"
    )


def test_the_documented_rule_without_its_script_still_fails(tmp_path):
    """udev logs the failed RUN at every add; the rule is what to remove."""
    write(tmp_path, "/etc/udev/rules.d/99-tpu-vfiopci.rules", VFIO_RULES)
    found = check(tmp_path, "leftover-vfio-binder")
    assert (found.status, found.fix) == (
        "FAIL",
        "remove /etc/udev/rules.d/99-tpu-vfiopci.rules: tpuboot binds TPUs itself",
    )


def test_a_binder_is_found_by_what_its_script_does_not_its_name(tmp_path):
    write(tmp_path, "/lib/udev/rules.d/60-accel-vfio.rules", 'ACTION=="add", RUN+="tpu-bind %k"\n')
    write(tmp_path, "/lib/udev/tpu-bind", BIND_SCRIPT)  # udev runs a relative program from /lib/udev
    found = check(tmp_path, "leftover-vfio-binder")
    assert (found.status, found.fix) == (
        "FAIL",
        "remove /lib/udev/rules.d/60-accel-vfio.rules (and /lib/udev/tpu-bind): tpuboot binds TPUs itself",
    )


def test_a_rule_setting_driver_override_is_a_binder(tmp_path):
    write(
        tmp_path,
        "/etc/udev/rules.d/80-vfio.rules",
        'SUBSYSTEM=="pci", ATTR{vendor}=="0x1ae0", ATTR{driver_override}="vfio-pci"\n',
    )
    assert check(tmp_path, "leftover-vfio-binder").status == "FAIL"


@pytest.mark.parametrize(
    "rules",
    [
        "",
        TPUBOOT_RULE,
        "".join(f"# {line}\n" for line in VFIO_RULES.splitlines()),  # commented out
        'SUBSYSTEM=="pci", ATTRS{vendor}=="0x1ae0", TAG+="bind_to_vfio_pci"\n',  # a tag runs nothing
        'SUBSYSTEM=="net", RUN+="/usr/bin/logger net up"\n',
        'ACTION=="add", RUN+="/usr/bin/tpuboot bind $kernel"\n',  # tpuboot's own program
    ],
)
def test_no_binder_in_harmless_rules(tmp_path, rules):
    write(tmp_path, "/etc/udev/rules.d/90-local.rules", rules)
    write(tmp_path, "/usr/bin/logger", "#!/bin/sh\n")
    write(tmp_path, "/usr/bin/tpuboot", "# writes vfio-pci to driver_override, as a binder does\n")
    found = check(tmp_path, "leftover-vfio-binder")
    assert (found.status, found.detail) == ("PASS", "no udev rule binds to vfio-pci but tpuboot")


def test_a_masked_documented_rule_is_no_binder(tmp_path):
    write(tmp_path, "/lib/udev/rules.d/99-tpu-vfiopci.rules", VFIO_RULES)
    (tmp_path / "etc/udev/rules.d").mkdir(parents=True)
    (tmp_path / "etc/udev/rules.d/99-tpu-vfiopci.rules").symlink_to("/dev/null")
    write(tmp_path, "/lib/udev/bind_to_vfio_pci.sh", BIND_SCRIPT)
    found = check(tmp_path, "leftover-vfio-binder")  # the script is left, run by nothing
    assert found.status == "WARN"
    assert found.detail == "/lib/udev/bind_to_vfio_pci.sh binds devices to vfio-pci; no udev rule runs it"
    assert found.fix.startswith("remove /lib/udev/bind_to_vfio_pci.sh: ")


def test_merged_usr_names_the_script_once(tmp_path):
    write(tmp_path, "/usr/lib/udev/bind_to_vfio_pci.sh", BIND_SCRIPT)
    (tmp_path / "lib").symlink_to("usr/lib")
    found = check(tmp_path, "leftover-vfio-binder")
    assert found.status == "WARN" and found.detail.count("bind_to_vfio_pci.sh") == 1


# --- The accel rule -----------------------------------------------------------------------------


def test_documented_accel_rule_beside_tpuboots_warns(tmp_path):
    write(tmp_path, "/lib/udev/rules.d/70-tpuboot.rules", TPUBOOT_RULE)
    write(tmp_path, "/etc/udev/rules.d/99-tpu.rules", 'KERNEL=="accel*" MODE="0666"\n')
    found = check(tmp_path, "leftover-accel-rule")
    assert found.status == "WARN"
    assert found.detail.startswith("/etc/udev/rules.d/99-tpu.rules also sets the accel* mode")
    assert found.fix.startswith("remove /etc/udev/rules.d/99-tpu.rules: tpuboot's 70-tpuboot.rules sets it")


@pytest.mark.parametrize(
    ("path", "text"),
    [
        ("/etc/udev/rules.d/70-tpuboot.rules", 'KERNEL=="accel*", MODE="0660", GROUP="tpu"\n'),  # override
        ("/etc/udev/rules.d/99-apex.rules", 'KERNEL=="apex*", MODE="0666"\n'),
        ("/etc/udev/rules.d/99-tpu.rules", '# KERNEL=="accel*" MODE="0666"\n'),
    ],
)
def test_accel_rule_not_flagged(tmp_path, path, text):
    write(tmp_path, "/lib/udev/rules.d/70-tpuboot.rules", TPUBOOT_RULE)
    write(tmp_path, path, text)
    assert check(tmp_path, "leftover-accel-rule").status == "PASS"


def test_accel_rule_without_tpuboots_is_no_leftover(tmp_path):
    write(tmp_path, "/etc/udev/rules.d/99-tpu.rules", 'KERNEL=="accel*" MODE="0666"\n')
    assert check(tmp_path, "leftover-accel-rule").status == "SKIP"


# --- The tpu-env writer -----------------------------------------------------------------------------


def test_cloud_config_baked_into_the_image_fails(tmp_path):
    write(tmp_path, "/etc/cloud/cloud.cfg.d/99-tpu.cfg", CLOUD_CONFIG)
    found = check(tmp_path, "leftover-tpu-env-writer")
    assert found.status == "FAIL"
    assert found.detail == "/etc/cloud/cloud.cfg.d/99-tpu.cfg: runs at boot and writes tpu-env"
    assert found.fix.startswith("remove /etc/cloud/cloud.cfg.d/99-tpu.cfg: tpuboot writes tpu-env")


def test_per_boot_script_running_the_documented_script_names_both(tmp_path):
    write(tmp_path, "/var/scripts/configure-env-vars.sh", ENV_VARS_SCRIPT)
    write(
        tmp_path,
        "/var/lib/cloud/scripts/per-boot/10-tpu",
        "#!/bin/sh\nbash /var/scripts/configure-env-vars.sh\n",
    )
    found = check(tmp_path, "leftover-tpu-env-writer")
    assert found.status == "FAIL"
    assert found.detail.startswith(
        "/var/lib/cloud/scripts/per-boot/10-tpu (running /var/scripts/configure-env-vars.sh)"
    )
    assert found.fix.startswith(
        "remove /var/lib/cloud/scripts/per-boot/10-tpu and /var/scripts/configure-env-vars.sh: "
    )


def test_current_instances_user_data_is_read_under_the_root(tmp_path):
    """/var/lib/cloud/instance is an absolute link: followed inside the tree, not on the host."""
    write(tmp_path, "/var/lib/cloud/instances/i-1/user-data.txt", CLOUD_CONFIG)
    write(tmp_path, "/var/lib/cloud/instances/i-0/user-data.txt", "#cloud-config\n")
    (tmp_path / "var/lib/cloud/instance").symlink_to("/var/lib/cloud/instances/i-1")
    found = check(tmp_path, "leftover-tpu-env-writer")
    assert found.status == "FAIL"
    assert found.detail.startswith("/var/lib/cloud/instances/i-1/user-data.txt:")


def test_a_script_nothing_runs_warns(tmp_path):
    write(tmp_path, "/var/scripts/configure-env-vars.sh", ENV_VARS_SCRIPT)
    found = check(tmp_path, "leftover-tpu-env-writer")
    assert found.status == "WARN"
    assert "nothing in the image runs it" in found.detail
    assert found.fix.startswith("remove /var/scripts/configure-env-vars.sh and any runcmd that runs it")


def test_a_writer_under_another_name_is_found(tmp_path):
    write(
        tmp_path,
        "/etc/rc.local",
        "#!/bin/sh\ncurl -s -H 'Metadata-Flavor: Google' $MDS/x > /home/tpu-runtime/tpu-env\n",
    )
    assert check(tmp_path, "leftover-tpu-env-writer").status == "FAIL"


@pytest.mark.parametrize(
    "script",
    [
        "#!/bin/sh\n. /home/tpu-runtime/tpu-env\nexec /opt/train\n",  # reads it
        "#!/bin/sh\ntpuboot env\n",
        "#!/bin/sh\ncp /home/tpu-runtime/tpu-env /tmp/backup\n",
    ],
)
def test_readers_of_tpu_env_are_not_writers(tmp_path, script):
    write(tmp_path, "/var/lib/cloud/scripts/per-boot/50-train", script)
    write(tmp_path, "/var/scripts/train.sh", script)
    assert check(tmp_path, "leftover-tpu-env-writer").status == "PASS"


def test_tpuboots_own_files_are_not_writers(tmp_path):
    write(
        tmp_path,
        "/etc/systemd/system/tpuboot-extra.service",
        "[Service]\nExecStart=/bin/sh -c 'x > /a/tpu-env'\n",
    )
    write(tmp_path, "/etc/systemd/system/tpuboot.service.d/override.conf", "[Service]\n")
    assert check(tmp_path, "leftover-tpu-env-writer").status == "PASS"


# --- /etc/environment appenders -----------------------------------------------------------------


def test_documented_gcs_script_at_boot_fails(tmp_path):
    write(tmp_path, "/var/scripts/configure-gcs-timeouts.sh", GCS_SCRIPT)
    write(
        tmp_path,
        "/etc/cloud/cloud.cfg.d/99-tpu.cfg",
        "runcmd:\n - bash /var/scripts/configure-gcs-timeouts.sh\n",
    )
    found = check(tmp_path, "leftover-environment-appender")
    assert found.status == "FAIL"
    assert found.fix == (
        "remove /etc/cloud/cloud.cfg.d/99-tpu.cfg and /var/scripts/configure-gcs-timeouts.sh: "
        "tpuboot sets each env.environment key once"
    )


def test_cloudsdk_python_appended_from_cron_fails(tmp_path):
    write(
        tmp_path,
        "/etc/cron.d/tpu",
        '@reboot root grep -q CLOUDSDK_PYTHON /etc/environment || echo "CLOUDSDK_PYTHON=/usr/bin/python3" '
        ">> /etc/environment\n",
    )
    assert check(tmp_path, "leftover-environment-appender").status == "FAIL"


@pytest.mark.parametrize(
    "script",
    [
        'echo "HTTP_PROXY=http://proxy:3128" >> /etc/environment\n',  # not one of tpuboot's keys
        "grep -q GCS_RESOLVE_REFRESH_SECS= /etc/environment && echo set\n",  # reads only
        'echo "GCS_RESOLVE_REFRESH_SECS=60" >> /tmp/env\n',  # another file
    ],
)
def test_harmless_environment_edits_pass(tmp_path, script):
    write(tmp_path, "/var/lib/cloud/scripts/per-boot/20-env", script)
    assert check(tmp_path, "leftover-environment-appender").status == "PASS"


# --- get-vm-metadata.py ---------------------------------------------------------------------------


def test_metadata_helper_warns(tmp_path):
    write(tmp_path, "/var/scripts/get-vm-metadata.py", GET_VM_METADATA)
    found = check(tmp_path, "leftover-metadata-script")
    assert found.status == "WARN"
    assert found.fix.startswith("remove /var/scripts/get-vm-metadata.py: `tpuboot metadata get KEY")


def test_scripts_reading_a_fixed_value_are_not_the_helper(tmp_path):
    write(
        tmp_path,
        "/usr/local/bin/zone",
        "curl -H 'Metadata-Flavor: Google' $MDS/computeMetadata/v1/instance/zone\n",
    )
    write(tmp_path, "/var/scripts/configure-env-vars.sh", ENV_VARS_SCRIPT)  # another check's
    assert check(tmp_path, "leftover-metadata-script").status == "PASS"


# --- limits.conf ------------------------------------------------------------------------------------


def test_documented_limits_lines_beside_tpuboots_dropin_warn(tmp_path):
    write(tmp_path, "/etc/security/limits.d/tpuboot.conf", (REPO / "conf/limits.d/tpuboot.conf").read_text())
    write(tmp_path, "/etc/security/limits.conf", "# /etc/security/limits.conf\n" + DOCUMENTED_LIMITS)
    found = check(tmp_path, "leftover-limits-conf")
    assert found.status == "WARN"
    assert "* hard memlock unlimited" in found.detail and "root hard nofile 100000" in found.detail
    assert found.fix.startswith("remove the memlock and nofile lines from /etc/security/limits.conf")


@pytest.mark.parametrize(
    "text", ["", "# *  hard  memlock  unlimited\n", "@audio - memlock unlimited\n*  hard  nproc  4096\n"]
)
def test_other_limits_pass(tmp_path, text):
    write(tmp_path, "/etc/security/limits.d/tpuboot.conf", "* - memlock unlimited\n")
    write(tmp_path, "/etc/security/limits.conf", text)
    assert check(tmp_path, "leftover-limits-conf").status == "PASS"


def test_limits_without_tpuboots_dropin_are_no_leftover(tmp_path):
    write(tmp_path, "/etc/security/limits.conf", DOCUMENTED_LIMITS)
    assert check(tmp_path, "leftover-limits-conf").status == "SKIP"


# --- /etc/default/grub --------------------------------------------------------------------------------


def documented_grub_edits(tmp_path: Path) -> str:
    """/etc/default/grub after the procedure's two sed commands, run as written."""
    grub = write(tmp_path, "/etc/default/grub", 'GRUB_DEFAULT=0\nGRUB_CMDLINE_LINUX=""\n')
    for expression, extended in (
        ('s/GRUB_CMDLINE_LINUX=""/GRUB_CMDLINE_LINUX="idle=poll intel_iommu=on,sm_on"/', False),
        ('s/GRUB_CMDLINE_LINUX="[a-zA-Z0-9_= ]*/& transparent_hugepage=always/', True),
    ):
        argv = ["sed", "-i", *(["-r"] if extended else []), expression, str(grub)]
        subprocess.run(argv, check=True)
    return grub.read_text()


@pytest.mark.skipif(shutil.which("sed") is None, reason="no sed")
def test_documented_sed_mangles_the_iommu_parameter_and_fails(tmp_path):
    text = documented_grub_edits(tmp_path)
    assert 'GRUB_CMDLINE_LINUX="idle=poll intel_iommu=on transparent_hugepage=always,sm_on"' in text
    write(tmp_path, "/etc/default/grub.d/tpuboot.cfg", "")
    found = check(tmp_path, "leftover-grub-cmdline")
    assert found.status == "FAIL"
    assert "adds nothing for intel_iommu, transparent_hugepage" in found.detail
    assert found.fix.startswith(
        "remove intel_iommu=on transparent_hugepage=always,sm_on from /etc/default/grub"
    )


def test_right_values_beside_tpuboots_dropin_warn(tmp_path):
    write(
        tmp_path,
        "/etc/default/grub",
        'GRUB_CMDLINE_LINUX="console=ttyS0 idle=poll intel_iommu=on,sm_on transparent_hugepage=always"\n',
    )
    write(tmp_path, "/etc/default/grub.d/tpuboot.cfg", "")
    found = check(tmp_path, "leftover-grub-cmdline")
    assert found.status == "WARN"
    assert found.fix.startswith(
        "remove idle=poll intel_iommu=on,sm_on transparent_hugepage=always from /etc/default/grub"
    )


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ('GRUB_CMDLINE_LINUX_DEFAULT="quiet console=ttyS0"\nGRUB_CMDLINE_LINUX=""\n', "PASS"),
        ('# GRUB_CMDLINE_LINUX="idle=halt"\nGRUB_CMDLINE_LINUX=""\n', "PASS"),
        ('GRUB_CMDLINE_LINUX_DEFAULT="idle=halt"\n', "FAIL"),  # read there too by the drop-in
        ('GRUB_CMDLINE_LINUX="idle=halt"\nGRUB_CMDLINE_LINUX=""\n', "PASS"),  # the last one counts
    ],
)
def test_grub_lines(tmp_path, text, status):
    write(tmp_path, "/etc/default/grub", text)
    write(tmp_path, "/etc/default/grub.d/tpuboot.cfg", "")
    assert check(tmp_path, "leftover-grub-cmdline").status == status


@pytest.mark.parametrize(
    "typed", ['"$GRUB_CMDLINE_LINUX idle=halt"', "'idle=halt;reboot'", '"#idle=halt"', "'a\\ b'"]
)
def test_a_line_grub_would_reinterpret_is_cannot_tell(tmp_path, typed):
    """The typed line is split as GRUB splits it (the next-boot checks' one reading): where GRUB
    or the shell would make something else of it, the check says it cannot tell, never PASS."""
    write(tmp_path, "/etc/default/grub", f"GRUB_CMDLINE_LINUX={typed}\n")
    write(tmp_path, "/etc/default/grub.d/tpuboot.cfg", "")
    found = check(tmp_path, "leftover-grub-cmdline")
    assert found.status == "WARN", found
    assert found.detail.startswith("cannot tell which parameters /etc/default/grub sets: ")


def test_right_values_without_tpuboots_dropin_are_needed(tmp_path):
    write(tmp_path, "/etc/default/grub", 'GRUB_CMDLINE_LINUX="idle=poll"\n')
    assert check(tmp_path, "leftover-grub-cmdline").status == "PASS"


# --- Duplicated /etc/environment lines ----------------------------------------------------------


def test_lines_appended_at_every_boot_warn(tmp_path):
    appended = "".join(line.split('"')[1] + "\n" for line in GCS_SCRIPT.splitlines())
    write(tmp_path, "/etc/environment", 'PATH="/usr/bin"\n' + appended * 3)  # three boots
    found = check(tmp_path, "leftover-environment-duplicates")
    assert found.status == "WARN"
    assert "GCS_RESOLVE_REFRESH_SECS 3 times" in found.detail and "PATH" not in found.detail
    assert found.fix.startswith("keep one line per variable in /etc/environment")


@pytest.mark.parametrize("text", ['PATH="/usr/bin"\nGCS_A=1\n', "# GCS_A=2\nGCS_A=1\n", ""])
def test_single_assignments_pass(tmp_path, text):
    write(tmp_path, "/etc/environment", text)
    assert check(tmp_path, "leftover-environment-duplicates").status == "PASS"


# --- The command line and doctor --------------------------------------------------------------------


def procedure_image(tree: Path) -> None:
    write(tree, "/etc/udev/rules.d/99-tpu-vfiopci.rules", VFIO_RULES)
    write(tree, "/lib/udev/bind_to_vfio_pci.sh", BIND_SCRIPT)
    write(tree, "/etc/environment", "GCS_A=1\nGCS_A=1\n")


def test_image_check_only_runs_the_named_checks(tmp_path, capsys):
    procedure_image(tmp_path)
    status = cli.main(["--root", str(tmp_path), "image-check", "--only", "leftover-*"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    assert {line.split()[1].rstrip(":") for line in lines} == {
        name for name in (r.name for r in run_checks(Root(tmp_path))) if name.startswith("leftover-")
    }
    warn = next(line for line in lines if "leftover-environment-duplicates" in line)
    assert warn.startswith("WARN") and "  fix: keep one line" in warn  # a WARN shows its fix


def test_image_check_only_takes_a_comma_list_and_repeats(tmp_path, capsys):
    procedure_image(tmp_path)
    argv = ["--root", str(tmp_path), "image-check", "--only", "pam-nofile,leftover-vfio-binder"]
    cli.main([*argv, "--only", "accel-udev-rule", "--json"])
    out = capsys.readouterr().out
    assert [line.split('"')[3] for line in out.splitlines() if '"name"' in line] == [
        "pam-nofile",
        "accel-udev-rule",
        "leftover-vfio-binder",
    ]


def test_image_check_only_an_unknown_name_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["--root", str(tmp_path), "image-check", "--only", "leftover-nothing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpuboot: no check named 'leftover-nothing'; the names are cmdline-idle-poll")
    assert err.count("\n") == 1


def test_doctor_names_the_leftovers(tmp_path):
    procedure_image(tmp_path)
    verdicts = Doctor(
        Root(tmp_path),
        Config(),
        container_state=lambda root, name: "running",
    ).run()
    found = {v.result.name: v for v in verdicts}
    binder = found["leftover-vfio-binder"]
    assert (binder.result.status, binder.required) == ("FAIL", True)
    assert "99-tpu-vfiopci.rules" in binder.result.fix
    assert found["leftover-environment-duplicates"].result.status == "WARN"
