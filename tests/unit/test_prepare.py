"""``tpuboot prepare-image`` on temporary trees, with the fake dockerd and a recorded systemctl.

The real dockerd, systemd and cloud-init run in tests/vm/test_tpuboot_cloudinit.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.fakes.dockerd import FakeDockerd, fake_dockerd
from tpuboot import cli
from tpuboot.config import Config, EnvConfig, MetricsConfig, TelemetryConfig, VbarConfig
from tpuboot.containers.docker import DockerEngine
from tpuboot.containers.dockerapi import DockerAPI
from tpuboot.paths import Root
from tpuboot.prepare import Preparer
from tpuboot.verdicts import CheckResult

VBAR = VbarConfig().image
SHIPPED_DROPIN = (Path(__file__).resolve().parents[2] / "conf/grub.d/tpuboot.cfg").read_text()


class Systemctl:
    """systemctl as a recorder: ``show -P`` answers from ``props``, the rest is logged."""

    def __init__(self, **props: str) -> None:
        self.props = {"UnitFileState": "enabled", "ActiveState": "active", **props}
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> str:
        self.calls.append(args)
        if args[:2] == ("show", "-P"):
            return self.props[args[2]] + "\n"
        return ""


@pytest.fixture
def docker() -> Iterator[FakeDockerd]:
    with fake_dockerd() as fake:
        (fake.root / "run/systemd/system").mkdir(parents=True)
        yield fake


def state_files(root: Path) -> dict[str, str]:
    """Instance state as a TPU VM leaves it, and the image settings that must stay."""
    files = {
        "/var/lib/tpuboot/tpu-env.json": '{"format": 2}',
        "/var/lib/tpuboot/environment.lines": "CLOUDSDK_PYTHON=python3\n",
        "/home/tpu-runtime/tpu-env": 'WORKER_ID="3"\n',
        "/run/tpuboot/tpu-env.env": "WORKER_ID=3\n",
        "/run/tpuboot/tpu-env.docker": "WORKER_ID=3\n",
        "/etc/environment": "CLOUDSDK_PYTHON=python3\n",
        "/var/lib/node_exporter/tpuboot.prom": "tpuboot_tpus 4\n",
    }
    for path, text in files.items():
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/")).write_text(text)
    return files


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def preparer(fake: FakeDockerd, systemctl: Systemctl, config: Config | None = None) -> Preparer:
    return Preparer(
        Root(fake.root),
        config or Config(),
        systemctl=systemctl,
        engine=lambda: DockerEngine(DockerAPI(str(fake.socket_path))),
        live=True,
    )


def test_a_tpu_vm_used_as_build_vm_is_left_with_nothing_of_its_own(docker: FakeDockerd) -> None:
    files = state_files(docker.root)
    docker.images.add("tpuboot-test/busybox:1")
    docker.add_container("tpuboot-vbar-control-agent", VBAR, labels={"io.tpuboot.managed": "1"})
    docker.add_container("user-app", "tpuboot-test/busybox:1")
    systemctl = Systemctl()
    config = Config(metrics=MetricsConfig(textfile_dir="/var/lib/node_exporter"))

    results = by_name(preparer(docker, systemctl, config).run())

    assert results["service"].status == "PASS"
    assert results["service"].detail.startswith("tpuboot.service stopped (was active); enabled")
    assert ("stop", "tpuboot.service") in systemctl.calls
    assert results["containers"].detail == (
        "removed tpuboot-vbar-control-agent (label io.tpuboot.managed=1; their images stay)"
    )
    assert list(docker.containers) == ["user-app"]  # not tpuboot's: kept
    assert results["pull-vbar"].status == "PASS"
    assert docker.pulls == [("gcr.io/cloud-tpu-v2-images/vbar_control_agent", "0.0.1")]
    assert results["pull-telemetry"].status == "SKIP"
    gone = [p for p in files if not (docker.root / p.lstrip("/")).exists()]
    assert sorted(gone) == sorted(
        [
            "/var/lib/tpuboot/tpu-env.json",
            "/home/tpu-runtime/tpu-env",
            "/run/tpuboot/tpu-env.env",
            "/run/tpuboot/tpu-env.docker",
            "/var/lib/node_exporter/tpuboot.prom",
        ]
    )
    assert results["instance-state"].detail.startswith("removed /var/lib/tpuboot/tpu-env.json, ")


def test_a_stopped_service_is_not_stopped_again_and_a_disabled_one_fails(docker: FakeDockerd) -> None:
    idle = Systemctl(ActiveState="inactive")
    assert by_name(preparer(docker, idle).run())["service"].detail == "tpuboot.service enabled, not running"
    assert all(call[0] == "show" for call in idle.calls)
    disabled = by_name(preparer(docker, Systemctl(UnitFileState="disabled")).run())["service"]
    assert (disabled.status, disabled.fix) == ("FAIL", "systemctl enable tpuboot.service")


def test_the_collector_is_pulled_when_enabled(docker: FakeDockerd) -> None:
    config = Config(telemetry=TelemetryConfig(enabled=True))
    results = by_name(preparer(docker, Systemctl(), config).run())
    assert results["pull-telemetry"].detail == f"pulled {TelemetryConfig().image}"
    assert len(docker.pulls) == 2


def test_a_failed_pull_fails_unless_dockerd_has_the_image(docker: FakeDockerd) -> None:
    docker.pull_error = "registry unreachable"
    result = by_name(preparer(docker, Systemctl()).run())["pull-vbar"]
    assert result.status == "FAIL"
    assert (
        "cannot pull gcr.io/cloud-tpu-v2-images/vbar_control_agent:0.0.1: registry unreachable"
        in result.detail
    )
    docker.images.add(VBAR)
    result = by_name(preparer(docker, Systemctl()).run())["pull-vbar"]
    assert result.status == "WARN"
    assert "the copy dockerd has will be used" in result.detail


def test_no_dockerd_fails_the_pull_with_the_fix_or_skips_it_when_vbar_is_off(docker: FakeDockerd) -> None:
    docker.stop()
    results = by_name(preparer(docker, Systemctl()).run())
    assert results["pull-vbar"].status == "FAIL"
    assert results["pull-vbar"].fix.startswith("install docker.io and start dockerd before prepare-image")
    assert results["containers"].status == "SKIP"
    off = by_name(preparer(docker, Systemctl(), Config(vbar=VbarConfig(enabled=False))).run())
    assert off["pull-vbar"].status == "SKIP"


def test_an_image_refused_by_the_allowlist_is_not_pulled(docker: FakeDockerd) -> None:
    config = Config(vbar=VbarConfig(image="gcr.io/x/vbar:1", registries=("us-docker.pkg.dev",)))
    result = by_name(preparer(docker, Systemctl(), config).run())["pull-vbar"]
    assert result.status == "FAIL" and "refused" in result.detail
    assert docker.pulls == []


def test_a_directory_where_tpu_env_goes_is_left_and_named(tmp_path: Path) -> None:
    (tmp_path / "home/tpu-runtime/tpu-env").mkdir(parents=True)
    result = by_name(Preparer(Root(tmp_path), Config()).run())["instance-state"]
    assert result.status == "FAIL" and "/home/tpu-runtime/tpu-env is a directory" in result.detail


def test_a_link_is_removed_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / "home/tpu-runtime").mkdir(parents=True)
    os.symlink(target, tmp_path / "home/tpu-runtime/tpu-env")
    Preparer(Root(tmp_path), Config()).run()
    assert target.read_text() == "keep" and not (tmp_path / "home/tpu-runtime/tpu-env").is_symlink()


def test_an_image_tree_is_cleaned_and_judged_by_its_next_boot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_files(tmp_path)
    (tmp_path / "etc/default/grub.d").mkdir(parents=True)
    (tmp_path / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX=""\n')
    (tmp_path / "etc/default/grub.d/tpuboot.cfg").write_text(SHIPPED_DROPIN)
    (tmp_path / "var/lib/dpkg").mkdir(parents=True)
    (tmp_path / "var/lib/dpkg/arch").write_text("amd64\n")
    status = cli.main(["--root", str(tmp_path), "prepare-image", "--json"])
    results = by_name([CheckResult(**r) for r in json.loads(capsys.readouterr().out)])
    assert {results[n].status for n in ("service", "containers", "pull-vbar")} == {"SKIP"}
    assert results["cmdline-intel-iommu"].status == "PASS"
    assert not (tmp_path / "var/lib/tpuboot/tpu-env.json").exists()
    assert (tmp_path / "var/lib/tpuboot/environment.lines").exists()  # an image setting: kept
    assert status == 1  # the tree has no limits drop-in, no udev rule: FAILs to fix
    assert results["pam-memlock"].status == "FAIL"


def test_the_text_output_is_one_line_per_step_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "home/tpu-runtime/tpu-env").mkdir(parents=True)
    assert cli.main(["--root", str(tmp_path), "prepare-image"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("FAIL  instance-state: /home/tpu-runtime/tpu-env is a directory")
        and "  fix: " in line
        for line in lines
    )
    assert [line.split()[1] for line in lines][-5:] == [
        "service:",
        "containers:",
        "pull-vbar:",
        "pull-telemetry:",
        "instance-state:",
    ]


def test_env_paths_from_the_configuration_are_the_ones_removed(tmp_path: Path) -> None:
    config = Config(env=EnvConfig(tpu_env_path="/opt/tpu/tpu-env", cache_dir="/srv/tpuboot"))
    for path in ("opt/tpu/tpu-env", "srv/tpuboot/tpu-env.json", "home/tpu-runtime/tpu-env"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    Preparer(Root(tmp_path), config).run()
    assert (
        not (tmp_path / "opt/tpu/tpu-env").exists() and not (tmp_path / "srv/tpuboot/tpu-env.json").exists()
    )
    assert (tmp_path / "home/tpu-runtime/tpu-env").exists()  # not tpuboot's file under this configuration


@pytest.mark.parametrize(
    ("links", "named"),
    [
        ({"/run/tpuboot": "/run/tpuboot"}, {"/run/tpuboot"}),  # a link to itself
        ({"/run/tpuboot": "a", "/run/a": "tpuboot"}, {"/run/tpuboot", "/run/a"}),  # two, relative
        (
            {"/var/lib/tpuboot": "/var/lib/x", "/var/lib/x": "/var/lib/tpuboot"},
            {"/var/lib/tpuboot", "/var/lib/x"},
        ),
        ({"/var/lib": "../var/lib"}, {"/var/lib"}),  # round through its parent
        ({"/run": "/run/x"}, {"/run"}),  # a link into itself
    ],
)
def test_a_symbolic_link_loop_fails_the_step_with_a_fix_that_names_the_link(
    tmp_path: Path, links: dict[str, str], named: set[str]
) -> None:
    """The loop's link named in the step's fix (the path alone hides which link to mend), and the
    same step fails on nothing else. A loop at the file itself is no loop to prepare-image: it
    removes the link, as it removes any (test_a_link_is_removed_not_followed)."""
    for path, target in links.items():
        where = tmp_path / path.lstrip("/")
        where.parent.mkdir(parents=True, exist_ok=True)
        where.symlink_to(target)
    result = by_name(Preparer(Root(tmp_path), Config()).run())["instance-state"]
    assert result.status == "FAIL", result
    assert "more than 40 symbolic links, a loop through " in result.detail
    link = result.fix.removeprefix("remove the symbolic link ").partition(",")[0]
    assert link in named, result.fix
    assert result.fix.endswith(", or point it out of the loop; then run tpuboot prepare-image again")


def test_a_loop_where_an_image_check_reads_names_the_link_in_its_fix(tmp_path: Path) -> None:
    """The image checks prepare-image runs first: a file they read behind a loop FAILs with the
    link to mend, not "fix the file's permissions"."""
    (tmp_path / "etc/default").mkdir(parents=True)
    (tmp_path / "etc/default/grub").symlink_to("grub.d/../grub")
    (tmp_path / "etc/default/grub.d").mkdir()
    looped = [r for r in Preparer(Root(tmp_path), Config()).run() if "symbolic links, a loop" in r.detail]
    assert looped, "no check read /etc/default/grub"
    for result in looped:
        assert result.status == "FAIL"
        assert result.detail.startswith("cannot read: /etc/default/grub")  # Root.path or atomicfile
        assert result.fix == "remove the symbolic link /etc/default/grub, or point it out of the loop"
