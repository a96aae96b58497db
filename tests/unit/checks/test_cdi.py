"""Doctor's container checks on temporary trees: the spec against the bound chips, each engine's
CDI support by version and configuration, and the engines' memlock defaults."""

from __future__ import annotations

import json

import pytest

from tests.unit.fakes.kernel import FakeKernel
from tests.unit.helpers.devices import V5P, add_tpu, binder
from tpuboot.checks.cdi import CdiChecks, parse_version, toml_values
from tpuboot.containers import cdi, cdi_file


@pytest.fixture
def kernel(tmp_path):
    k = FakeKernel(tmp_path)
    add_tpu(k, "0000:00:04.0", V5P, driver="vfio-pci", group="4")
    return k


def checks(kernel: FakeKernel, versions: dict[str, str] | None = None) -> CdiChecks:
    return CdiChecks(kernel.root, binder(kernel), version_of=lambda path: (versions or {}).get(path))


def put(kernel: FakeKernel, path: str, text: str) -> None:
    kernel.p(path).parent.mkdir(parents=True, exist_ok=True)
    kernel.p(path).write_text(text)


def install(kernel: FakeKernel, program: str) -> None:
    put(kernel, program, "#!/bin/sh\n")


def test_the_spec_must_be_the_bound_chips(kernel) -> None:
    c = checks(kernel)
    assert c.check_spec().status == "FAIL" and "no /var/run/cdi" in c.check_spec().detail
    cdi_file.apply(kernel.root, cdi.host_spec(kernel.root, c.config, c.binder))
    assert c.check_spec().status == "PASS"
    add_tpu(kernel, "0000:00:05.0", V5P, driver="vfio-pci", group="5")
    result = c.check_spec()
    assert result.status == "FAIL" and "systemctl restart tpuboot" in result.fix
    put(kernel, cdi.SPEC_PATH, "{not json")
    assert "not JSON" in c.check_spec().detail


def test_a_spec_without_a_bound_chip_is_stale(tmp_path) -> None:
    kernel = FakeKernel(tmp_path)
    add_tpu(kernel, "0000:00:04.0", V5P, driver=None, group="4")
    c = checks(kernel)
    assert c.check_spec().status == "PASS"
    put(kernel, cdi.SPEC_PATH, "{}")
    assert c.check_spec().status == "FAIL"


CDI_ON = {"features": {"cdi": True}}


@pytest.mark.parametrize(
    ("version", "daemon_json", "status", "said"),
    [
        ("Docker version 24.0.7, build afdd53b", None, "FAIL", "does not read CDI"),
        ("Docker version 26.1.5+dfsg1, build a72d7cd", None, "FAIL", "CDI feature off"),
        ("Docker version 26.1.5+dfsg1, build a72d7cd", {"features": {"cdi": True}}, "PASS", "feature cdi on"),
        ("Docker version 28.2.2, build e6534b4", None, "PASS", "on by default"),
        ("Docker version 28.2.2, build e6534b4", {"features": {"cdi": False}}, "FAIL", "off"),
        ("Docker version 27.5.1", {**CDI_ON, "cdi-spec-dirs": ["/etc/cdi"]}, "FAIL", "leaves out"),
        ("Docker version 27.5.1", {**CDI_ON, "cdi-spec-dirs": ["/run/cdi/"]}, "PASS", "reads"),
        (None, None, "WARN", "unknown"),
    ],
)  # fmt: skip
def test_docker_reads_cdi_from_25_with_its_feature_and_from_28_2_by_default(
    kernel, version, daemon_json, status, said
) -> None:
    install(kernel, "/usr/sbin/dockerd")
    if daemon_json is not None:
        put(kernel, "/etc/docker/daemon.json", json.dumps(daemon_json))
    result = checks(kernel, {"/usr/sbin/dockerd": version} if version else {}).check_docker()
    assert (result.status, said in result.detail) == (status, True), result
    if status == "FAIL":
        assert result.fix


def test_engines_not_installed_are_skipped(kernel) -> None:
    c = checks(kernel)
    assert [c.check_docker().status, c.check_podman().status, c.check_containerd().status] == ["SKIP"] * 3
    assert c.check_memlock().status == "SKIP"


CRI_17 = """version = 2
[plugins]
  [plugins."io.containerd.grpc.v1.cri"] # the CRI plugin
    enable_cdi = true
    cdi_spec_dirs = [
      "/etc/cdi",  # static
      "/var/run/cdi",
    ]
"""


def test_containerd_17_needs_enable_cdi_and_2_0_has_it_on(kernel) -> None:
    install(kernel, "/usr/bin/containerd")
    v17 = {"/usr/bin/containerd": "containerd github.com/containerd/containerd 1.7.24 88bf19b"}
    result = checks(kernel, v17).check_containerd()
    assert result.status == "WARN" and "enable_cdi = true" in result.fix  # only CRI clients need it
    put(kernel, "/etc/containerd/config.toml", CRI_17)
    assert checks(kernel, v17).check_containerd().status == "PASS"
    put(kernel, "/etc/containerd/config.toml", CRI_17.replace('"/var/run/cdi",', ""))
    assert "leaves out" in checks(kernel, v17).check_containerd().detail
    put(kernel, "/etc/containerd/config.toml", "")
    v20 = {"/usr/bin/containerd": "containerd containerd.io v2.0.4 1a43cb6a"}
    assert checks(kernel, v20).check_containerd().status == "PASS"
    v16 = {"/usr/bin/containerd": "containerd github.com/containerd/containerd 1.6.20 1234"}
    assert "1.7 is the first" in checks(kernel, v16).check_containerd().detail
    put(kernel, "/etc/containerd/config.toml", 'disabled_plugins = ["cri"]\n')  # Docker's containerd.io
    assert checks(kernel, v17).check_containerd().status == "SKIP"


def test_podman_always_reads_unless_its_spec_dirs_leave_ours_out(kernel) -> None:
    install(kernel, "/usr/bin/podman")
    c = checks(kernel, {"/usr/bin/podman": "podman version 4.3.1"})
    assert c.check_podman().status == "PASS" and "4.3" in c.check_podman().detail
    put(kernel, "/etc/containers/containers.conf", "[engine]\ncdi_spec_dirs = ['/etc/cdi']\n")
    assert c.check_podman().status == "FAIL"


def test_an_engine_default_below_unlimited_memlock_fails(kernel) -> None:
    install(kernel, "/usr/sbin/dockerd")
    install(kernel, "/usr/bin/podman")
    c = checks(kernel)
    assert c.check_memlock().status == "PASS"
    limited = {"default-ulimits": {"memlock": {"Name": "memlock", "Soft": 65536, "Hard": 65536}}}
    put(kernel, "/etc/docker/daemon.json", json.dumps(limited))
    put(
        kernel,
        "/etc/containers/containers.conf",
        '[containers]\ndefault_ulimits = [\n "memlock=8192:8192",\n]\n',
    )
    result = c.check_memlock()
    assert result.status == "FAIL"
    assert "65536:65536" in result.detail and "memlock=8192:8192" in result.detail
    assert "--ulimit memlock=-1:-1" in result.fix
    unlimited = {"default-ulimits": {"memlock": {"Name": "memlock", "Soft": -1, "Hard": -1}}}
    put(kernel, "/etc/docker/daemon.json", json.dumps(unlimited))
    put(kernel, "/etc/containers/containers.conf", '[containers]\ndefault_ulimits = ["memlock=-1:-1"]\n')
    assert c.check_memlock().status == "PASS"


def test_the_toml_reader_knows_tables_quotes_comments_and_arrays() -> None:
    text = "a = 'x # not a comment'\n[t.'q.r'] # c\nb = false\nc = [\"1\",\n \"2\"]\n"
    assert list(toml_values(text)) == [
        ((), "a", "x # not a comment"),
        (("t", "q.r"), "b", False),
        (("t", "q.r"), "c", ["1", "2"]),
    ]


def test_versions_are_read_from_what_the_programs_print() -> None:
    assert parse_version("Docker version 26.1.5+dfsg1, build a72d7cd") == (26, 1)
    assert parse_version("containerd containerd.io v2.0.4 1a43cb6a") == (2, 0)
    assert parse_version(None) is None
