"""Containers without --privileged, on a real kernel with the real engines: podman 4.3 (Debian 12)
and Docker 26 (Debian 13, its CDI feature on) give a container the stand-in TPUs through nothing but
tpuboot's CDI spec, and the spec follows hotplug.

One boot per engine (module-scoped, parametrized). Each guest has two edu stand-ins at boot and a
hotplug port for a third. The container image is a tarball imported into the engine (no registry):
busybox, with the guest's own /usr bind-mounted read-only for python3 and vfio_read.py, which walks
the VFIO path libtpu takes (container, group, device fd) and reads BAR0. The containers run as
uid 1000 without --privileged, with no capability added.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.mds_emulator import HOSTILE_VALUES, SAMPLE_TPU_ENV
from harness.vm.artifacts import DOCKER_TRIXIE, PODMAN_BOOKWORM, Platform
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    EDU,
    EDU_ID_REGISTER,
    PROBE_IMAGE,
    PROBE_TAR,
    VFIO_READ,
    guest_config,
    package_install_hook,
    probe_rootfs_tar,
    put_tpu_env,
    set_attribute,
    write_in_tree,
)
from tpuboot.config import EnvConfig
from tpuboot.containers.cdi import (
    MAX_VALUE_BYTES,
    SHARED_KEYS,
    SPEC_PATH,
    WHOLE_HOST_KEYS,
    extras_of,
    name_of,
)
from tpuboot.devices.chips import base_address

from .conftest import BenchFactory

pytestmark = pytest.mark.vm

SPEC = SPEC_PATH
# Docker: CDI behind its feature flag (Docker 26); its default bridge network and iptables kept, as
# on a host: the containers run on the engine's default network.
DOCKER_DAEMON_JSON = '{"features": {"cdi": true}}\n'


@dataclass(frozen=True)
class Engine:
    name: str  # the command: podman or docker
    platform: Platform
    run_options: tuple[str, ...]  # what the man page's line for the engine adds


ENGINES = [
    Engine("podman", PODMAN_BOOKWORM, ()),
    Engine("docker", DOCKER_TRIXIE, ("--ulimit", "memlock=-1:-1")),
]


#: vBar's stand-in, supervised by tpuboot (``runtime: exec``) at tpuboot's default vbar.endpoint,
#: 127.0.0.1:8353: Python's HTTP server, which answers a request line with a status line.
VBAR = {
    "enabled": True,
    "runtime": "exec",
    "exec_argv": [
        "/usr/bin/python3",
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        "--directory",
        "/usr/share",
        "8353",
    ],
}
#: In the container: a request to vBar through VBAR_CONTROL_SERVICE_URL's unix socket, its answer's
#: first line printed; then a file written to /tmp/tpu_logs.
VBAR_CLIENT = (
    "import os, socket; url = os.environ['VBAR_CONTROL_SERVICE_URL']; "
    "s = socket.socket(socket.AF_UNIX); s.settimeout(60); s.connect(url[len('unix://'):]); "
    "s.sendall(b'HEAD / HTTP/1.0\\r\\n\\r\\n'); "
    "print('vbar', url, s.makefile('rb').readline().decode().strip()); "
    "open('/tmp/tpu_logs/probe-%d' % os.getpid(), 'w').write('written'); "
    "[print(k + '=' + v) for k, v in sorted(os.environ.items()) if k.startswith(('TPU_', 'VBAR_'))]"
)


def install_hook(deb: Path, engine: Engine) -> Callable[[Path], None]:
    base = package_install_hook(deb, guest_config(vbar=VBAR))

    def hook(tree: Path) -> None:
        base(tree)
        write_in_tree(tree, PROBE_TAR, "")
        (tree / PROBE_TAR.lstrip("/")).write_bytes(probe_rootfs_tar())
        # Loaded at boot (systemd-modules-load, before tpuboot): under a loaded host's TCG a first
        # modprobe can outlast tpuboot's 30 s bound, and module loading is not this module's subject.
        write_in_tree(tree, "/etc/modules-load.d/tpuboot-test-vfio.conf", "vfio-pci\n")
        if engine.name == "docker":
            write_in_tree(tree, "/etc/docker/daemon.json", DOCKER_DAEMON_JSON)

    return hook


@pytest.fixture(scope="module", params=ENGINES, ids=lambda e: e.name)
def vm(
    request: pytest.FixtureRequest, vm_bench: BenchFactory, tpuboot_deb: Path
) -> Iterator[tuple[VM, Engine]]:
    engine: Engine = request.param
    bench = vm_bench(engine.platform)
    image = bench.image(install_hook(tpuboot_deb, engine), key=f"tpuboot-cdi-{engine.name}")
    with VM.from_artifacts(
        bench.artifacts,
        image,
        devices=["edu", "edu"],
        hotplug_ports=1,
        memory=1536,
        name=f"cdi-{engine.name}",
    ) as m:
        m.wait_booted()
        m.run([engine.name, "import", PROBE_TAR, PROBE_IMAGE], check=True, timeout=300)
        m.wait_until(f"[ $(grep -c '\"name\"' {SPEC} 2>/dev/null) = 5 ]", timeout=120)  # both bound
        yield m, engine


def spec(vm: VM) -> dict:
    return json.loads(vm.read_file(SPEC))


def names(vm: VM) -> list[str]:
    return [d["name"] for d in spec(vm)["devices"]]


def container(
    vm: VM, engine: Engine, device: str, addresses: list[str], run_options: tuple[str, ...] | None = None
) -> dict[str, str]:
    """In a new container given ``google.com/tpu=device`` (and ``run_options``, by default the
    engine's documented ones): BAR0 of each address (or the error), the /dev/vfio nodes, the
    locked-memory limit and the TPU_ variables."""
    reads = "".join(f'echo "read {a} $(python3 {VFIO_READ} {a} 2>&1)"; ' for a in addresses)
    script = (
        f"{reads}echo \"nodes $(ls /dev/vfio | sort | tr '\\n' ' ')\"; "
        "echo \"memlock $(grep 'Max locked memory' /proc/self/limits | tr -s ' ' | cut -d' ' -f4,5)\"; "
        "env | grep ^TPU_ | sort | sed 's/^/env /'"
    )
    argv = [
        engine.name, "run", "--rm", "--user", "1000:1000",
        "--device", f"google.com/tpu={device}", *(engine.run_options if run_options is None else run_options),
        "-v", "/usr:/usr:ro", PROBE_IMAGE, "/bin/sh", "-c", script,
    ]  # fmt: skip
    out = vm.run(argv, check=True, timeout=300).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("read", "env"):
            name, _, value = value.partition(" ")
            key = f"{key} {name}"
        found[key] = value.strip()
    return found


def cdi_name(address: str) -> str:
    return name_of(base_address(address))


def edus(vm: VM) -> list[str]:
    return sorted(d.address for d in vm.pci_devices(*EDU))


def groups(vm: VM, addresses: list[str]) -> list[str]:
    script = " ".join(f"basename $(readlink /sys/bus/pci/devices/{a}/iommu_group);" for a in addresses)
    return vm.run(["sh", "-c", script], check=True).stdout.split()


def test_all_gives_every_stand_in_through_vfio_without_privileges(vm: tuple[VM, Engine]) -> None:
    m, engine = vm
    addresses = edus(m)
    assert len(addresses) == 2
    assert names(m) == ["0", cdi_name(addresses[0]), "1", cdi_name(addresses[1]), "all"]
    got = container(m, engine, "all", addresses)
    assert [got[f"read {a}"] for a in addresses] == [EDU_ID_REGISTER] * 2, got
    assert got["nodes"].split() == sorted([*groups(m, addresses), "vfio"])
    assert got["memlock"] == "unlimited unlimited"
    env = {key[4:] for key in got if key.startswith("env ")}
    assert "TPU_VISIBLE_CHIPS=0" not in env and "TPU_VISIBLE_CHIPS=1" not in env  # all: the whole host
    # tpu-env (the guest's metadata emulator serves the sample v5p-8) is in the spec: no metadata query
    assert {"TPU_SKIP_MDS_QUERY=true", "TPU_ACCELERATOR_TYPE=v5p-8", "TPU_TOPOLOGY=2x2x1",
            "TPU_CHIPS_PER_HOST_BOUNDS=2,2,1", "TPU_WORKER_ID=0",
            "TPU_RUNTIME_METRICS_PORTS=8431,8432"} <= env, env  # fmt: skip


def test_a_single_chip_device_gives_exactly_that_chip(vm: tuple[VM, Engine]) -> None:
    m, engine = vm
    first, second = edus(m)
    # Without the documented --ulimit: the limit is the engine's own (tpuboot's LimitMEMLOCK drop-ins
    # for docker.service and containerd.service; podman: its caller's), and it is enough.
    got = container(m, engine, "1", [first, second], run_options=())
    assert got["memlock"] == "unlimited unlimited"
    assert got[f"read {second}"] == EDU_ID_REGISTER
    assert "open /dev/vfio/" in got[f"read {first}"] and "ENOENT" in got[f"read {first}"]
    assert got["nodes"].split() == sorted([*groups(m, [second]), "vfio"])
    assert got["env TPU_VISIBLE_CHIPS=1"] == "" and "env TPU_PROCESS_BOUNDS=1,1,1" in got
    assert "env TPU_RUNTIME_METRICS_PORTS=8432" in got and "env TPU_CHIPS_PER_HOST_BOUNDS=1,1,1" in got


def test_the_spec_follows_a_hot_add_and_a_hot_remove(vm: tuple[VM, Engine]) -> None:
    m, engine = vm
    before = edus(m)
    m.device_add("edu", id="hot0", bus=m.hotplug_ports[0])
    deadline = time.monotonic() + 60
    while len(edus(m)) == len(before):
        assert time.monotonic() < deadline, "the hot-added stand-in did not show up"
        time.sleep(0.2)
    (added,) = [a for a in edus(m) if a not in before]
    m.wait_until(f'grep -q \'"name": "{cdi_name(added)}"\' {SPEC}', timeout=60)
    got = container(m, engine, "all", [added])
    assert got[f"read {added}"] == EDU_ID_REGISTER
    m.device_del("hot0")
    m.wait_until(f"! grep -q '{cdi_name(added)}' {SPEC}", timeout=60)
    assert names(m) == ["0", cdi_name(before[0]), "1", cdi_name(before[1]), "all"]
    got = container(m, engine, "all", [added, *before])
    assert got["nodes"].split() == sorted([*groups(m, before), "vfio"])
    assert [got[f"read {a}"] for a in before] == [EDU_ID_REGISTER] * 2
    assert "readlink" in got[f"read {added}"] and "ENOENT" in got[f"read {added}"]  # gone


def test_doctor_passes_the_engine_and_the_spec(vm: tuple[VM, Engine]) -> None:
    m, engine = vm
    out = m.run(["tpuboot", "doctor", "--json"], timeout=120).stdout
    found = {v["name"]: v for v in json.loads(out)}
    assert found["cdi-spec"]["status"] == "PASS", found["cdi-spec"]
    assert found[f"cdi-{engine.name}"]["status"] == "PASS", found[f"cdi-{engine.name}"]
    assert found["container-memlock"]["status"] == "PASS", found["container-memlock"]


def test_stop_removes_the_spec_and_start_writes_it_again(vm: tuple[VM, Engine]) -> None:
    m, _ = vm
    m.run(["systemctl", "stop", "tpuboot"], check=True, timeout=60)
    assert not m.run(["test", "-e", SPEC]).ok
    m.run(["systemctl", "start", "tpuboot"], check=True, timeout=120)
    m.wait_until(f"test -s {SPEC}", timeout=30)


def test_a_chip_held_through_its_vfio_device_cdev_is_named_held(vm: tuple[VM, Engine]) -> None:
    """The VFIO device cdev (/dev/vfio/devices/vfioN, iommufd) is a third way to hold a chip
    (Linux 6.6+, the kernels of Ubuntu 24.04 and Debian 13): `who` ties it to its chip by its
    device number. A guest kernel without it (Debian 12's 6.1) has nothing to test."""
    m, _ = vm
    address = edus(m)[0]
    # Every vfio device has its sysfs vfio-dev/vfioN; only a kernel built with the cdev
    # (CONFIG_VFIO_DEVICE_CDEV) gives it a device number, and so a /dev/vfio/devices node.
    found = m.run(["sh", "-c", f"cd /sys/bus/pci/devices/{address}/vfio-dev && ls */dev"], timeout=60)
    if found.rc != 0:
        kernel = m.run(["uname", "-r"], check=True).stdout.strip()
        pytest.skip(f"guest kernel {kernel} has no VFIO device cdev (CONFIG_VFIO_DEVICE_CDEV)")
    cdev = f"/dev/vfio/devices/{found.stdout.split()[0].split('/')[0]}"
    m.run(["systemd-run", "--unit=tpuboot-test-cdev", "sh", "-c", f"exec 3<>{cdev}; exec sleep 600"],
          check=True, timeout=60)  # fmt: skip
    try:
        m.wait_until(
            f"ls -l /proc/$(systemctl show -P MainPID tpuboot-test-cdev)/fd | grep -q {cdev}",
            timeout=60,
            interval=0.5,
        )
        pid = int(m.run(["systemctl", "show", "-P", "MainPID", "tpuboot-test-cdev"], check=True).stdout)
        report = json.loads(m.run(["tpuboot", "who", "--json"], timeout=60).stdout)
        (chip,) = [c for c in report["chips"] if address in c["functions"]]
        assert [(h["pid"], h["nodes"]) for h in chip["holders"]] == [(pid, [cdev])]
        assert report["unknown_chip_holders"] == []
    finally:
        m.run(["systemctl", "stop", "tpuboot-test-cdev"], timeout=60)


def relayed(vm: VM, engine: Engine, device: str) -> tuple[str, dict[str, str]]:
    """In an unprivileged container on the engine's default network (its own namespace behind the
    engine's bridge, where the host's 127.0.0.1:8353 is not vBar): vBar's answer through the relay
    socket, and the TPU_ and VBAR_ variables the spec gave."""
    argv = [
        engine.name, "run", "--rm", "--user", "1000:1000",
        "--device", f"google.com/tpu={device}", *engine.run_options,
        "-v", "/usr:/usr:ro", PROBE_IMAGE, "/usr/bin/python3", "-c", VBAR_CLIENT,
    ]  # fmt: skip
    out = vm.run(argv, check=True, timeout=300).stdout
    answer = next((line for line in out.splitlines() if line.startswith("vbar ")), "")
    env = dict(
        line.partition("=")[::2] for line in out.splitlines() if "=" in line and not line.startswith("vbar ")
    )
    return answer, env


def test_a_container_without_host_networking_reaches_vbar_and_writes_its_logs(vm: tuple[VM, Engine]) -> None:
    m, engine = vm
    m.wait_until("test -S /run/tpuboot/vbar/vbar.sock", timeout=120)
    m.wait_until(
        "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8353), 5)'", timeout=120
    )
    before = m.run(["sh", "-c", "ls /var/log/tpuboot/tpu_logs | wc -l"], check=True).stdout.strip()
    answer, env = relayed(m, engine, "all")
    assert answer.startswith("vbar unix:///var/run/tpu-plugin/vbar.sock HTTP/1.0 200"), answer
    assert env["VBAR_CONTROL_SERVICE_URL"] == "unix:///var/run/tpu-plugin/vbar.sock"
    after = m.run(["sh", "-c", "ls /var/log/tpuboot/tpu_logs | wc -l"], check=True).stdout.strip()
    assert int(after) == int(before) + 1  # the job's log file is on the host
    found = {v["name"]: v for v in json.loads(m.run(["tpuboot", "doctor", "--json"], timeout=120).stdout)}
    assert found["vbar-relay"]["status"] == "PASS", found["vbar-relay"]


#: In the container: its TPU_ and VBAR_ variables as one JSON object (exact, whatever they hold).
ENV_JSON = (
    "import json, os; "
    "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(('TPU_', 'VBAR_'))}))"
)
#: The tpu-env keys the spec carries (WORKER_ID apart: it marks which document the spec is from).
SPEC_SOURCES = [sources[0] for _, sources in (*SHARED_KEYS, *WHOLE_HOST_KEYS) if sources[0] != "WORKER_ID"]
#: Every hostile value of the metadata tests (a character beyond U+FFFF among them), and what only
#: a spec could choke on: a value over the spec's bound in ASCII and in UTF-8, an escape sequence,
#: DEL, NEL (a YAML line break), the byte-order mark and a non-character (no YAML file holds them).
SPEC_HOSTILE = [
    *HOSTILE_VALUES.values(),
    "x" * (MAX_VALUE_BYTES + 1),
    "é" * MAX_VALUE_BYTES,
    "\x1b[31m",
    "a\x7fb",
    "a\x85b",
    "a\ufeffb",
    "a\uffffb",
    "chip \U0001f600 \U0001d518",
]


def container_env(vm: VM, engine: Engine, device: str) -> dict[str, str]:
    argv = [
        engine.name, "run", "--rm", "--user", "1000:1000", "--device", f"google.com/tpu={device}",
        *engine.run_options, "-v", "/usr:/usr:ro", PROBE_IMAGE, "/usr/bin/python3", "-c", ENV_JSON,
    ]  # fmt: skip
    found: dict[str, str] = json.loads(vm.run(argv, check=True, timeout=300).stdout)
    return found


def hostile_documents() -> list[dict[str, str]]:
    """tpu-env documents that together put every hostile value in a spec key (the keys turned by
    one per document, so no kind of key sees only one kind of value), each marked by its
    WORKER_ID (11, 12, ...)."""
    documents = []
    width = len(SPEC_SOURCES)
    for n, start in enumerate(range(0, len(SPEC_HOSTILE), width)):
        keys = SPEC_SOURCES[n % width :] + SPEC_SOURCES[: n % width]
        values = dict(zip(keys, SPEC_HOSTILE[start : start + width], strict=False))
        documents.append({**SAMPLE_TPU_ENV, **values, "WORKER_ID": str(11 + n)})
    return documents


def test_a_hostile_tpu_env_leaves_a_spec_the_engine_accepts(vm: tuple[VM, Engine]) -> None:
    """Each value a container could not be given as it is (a control character, over the bound) is
    left out of the spec; the rest arrives in the container exactly; the engine takes the spec
    whole after every document, and a one-chip device still works."""
    m, engine = vm
    reasons: set[str] = set()
    try:
        for document in hostile_documents():
            put_tpu_env(m, document)
            m.wait_until(f"grep -q '\"TPU_WORKER_ID={document['WORKER_ID']}\"' {SPEC}", timeout=120)
            extras = extras_of(document, vbar=True)
            expected = dict(entry.partition("=")[::2] for entry in (*extras.shared, *extras.whole_host))
            got = container_env(m, engine, "all")
            assert {k: got.get(k) for k in expected} == expected
            assert not set(extras.dropped) & set(got), extras.dropped
            assert container_env(m, engine, "0")["TPU_VISIBLE_CHIPS"] == "0"
            reasons |= set(extras.dropped.values())
    finally:
        put_tpu_env(m, SAMPLE_TPU_ENV)
        m.wait_until(f"grep -q '\"TPU_WORKER_ID=0\"' {SPEC}", timeout=120)
    over = [f"is {size} bytes, over {MAX_VALUE_BYTES}" for size in (MAX_VALUE_BYTES + 1, 2 * MAX_VALUE_BYTES)]
    yaml = "holds a character no YAML file may hold (U+FEFF, U+FFFE or U+FFFF)"
    assert reasons == {"holds a control character (a newline, NUL...)", yaml, *over}  # each kind was tried


def test_without_tpu_env_the_spec_says_no_topology_until_it_arrives(vm: tuple[VM, Engine]) -> None:
    """A start with no tpu-env (the metadata server has none yet, no cache): no TPU_SKIP_MDS_QUERY
    (libtpu asks the metadata server, as on the host) and no topology, a one-chip device keeps its
    chip; when tpu-env arrives the spec is rewritten with it, with no restart."""
    m, engine = vm
    m.run(["systemctl", "stop", "tpuboot"], check=True, timeout=120)
    set_attribute(m, "tpu-env", None)
    try:
        m.run(["rm", "-f", f"{EnvConfig().cache_dir}/tpu-env.json", EnvConfig().tpu_env_path], check=True)
        m.run(["systemctl", "start", "tpuboot"], check=True, timeout=180)  # READY: the boot's sync ended
        m.wait_until(f"[ $(grep -c '\"name\"' {SPEC} 2>/dev/null) = 5 ]", timeout=120)
        text = m.read_file(SPEC).decode()
        assert "TPU_SKIP_MDS_QUERY" not in text and "TPU_TOPOLOGY" not in text
        assert "TPU_RUNTIME_METRICS_PORTS" not in text
        got = container(m, engine, "1", [])
        assert "env TPU_VISIBLE_CHIPS=1" in got and not any("TPU_SKIP_MDS_QUERY" in key for key in got)
    finally:
        put_tpu_env(m, SAMPLE_TPU_ENV)
    m.wait_until(f"grep -q TPU_SKIP_MDS_QUERY {SPEC}", timeout=120)
    assert "TPU_TOPOLOGY=2x2x1" in m.read_file(SPEC).decode()
