"""Registry credentials from the VM's service account, against a real registry and a real dockerd.

The guest runs Debian's docker-registry on 127.0.0.1:5000 with htpasswd authentication that
takes exactly one pair: user ``oauth2accesstoken`` and, as the password, the token the
in-guest metadata emulator serves at ``instance/service-accounts/default/token``. The vBar
stand-in is pushed there (with ``docker login``, then logged out: dockerd itself never reads
the CLI's credentials) and removed from dockerd, so tpuboot can only get it by sending the
token itself. ``registry_auth.token_registries`` lists ``localhost:5000`` for the test.

The module's tests run in file order on one guest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.peers import download_peers
from harness.mds_emulator import SAMPLE_TPU_ENV
from harness.vm.artifacts import Artifacts, chroot_run, in_tree, install_debs
from harness.vm.hostenv import cache_dir
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    MDS_PORT,
    VBAR_CONTAINER,
    VBAR_ROOTFS,
    guest_config,
    stand_in_install_hook,
    status_text,
    wait_vbar_running,
)

from .conftest import ImageFactory

pytestmark = pytest.mark.vm

NAME = VBAR_CONTAINER
REGISTRY = "localhost:5000"
IMAGE = f"{REGISTRY}/tpuboot-test/vbar:1"
# Within bcrypt's 72 bytes, which is all htpasswd compares; the two differ from the start.
TOKEN = "ya29.c.tpuboot-vm-test-8d3f0b6e1a2c4957b8e6d0f1a2b3c4d5"
WRONG_TOKEN = "ya29.c.not-this-vms-token-00000000000000000000000000000"
TOKEN_URL = f"http://127.0.0.1:{MDS_PORT}/_emulator/v1/instance/service-accounts/default/token"
HTPASSWD = "/etc/docker/registry/htpasswd"
REGISTRY_CONFIG = f"""version: 0.1
log:
  level: info
  fields:
    service: registry
storage:
  filesystem:
    rootdirectory: /var/lib/docker-registry
http:
  addr: 127.0.0.1:5000
auth:
  htpasswd:
    realm: tpuboot-test
    path: {HTPASSWD}
"""
TPU_ENV = {**SAMPLE_TPU_ENV, "VBARCONTROL_AGENT_DOCKER_URL": IMAGE}
# vBar off in the image: the test turns it on once the image is in the registry.
CONFIG_ON = guest_config(
    vbar={"enabled": True, "image": IMAGE, "registries": [REGISTRY]},
    registry_auth={"token_registries": [REGISTRY]},
    supervisor={"backoff_initial": 1, "backoff_max": 4, "stable_after": 60, "pull_retries": 1},
)
HTTP_SCRIPT = (
    "import sys, urllib.request; "
    "urllib.request.urlopen(urllib.request.Request(sys.argv[2], sys.argv[3].encode(), method=sys.argv[1]))"
)
BCRYPT_SCRIPT = (
    "import crypt, sys; "
    "print('oauth2accesstoken:' + crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH)))"
)


def install(deb: Path, registry_deb: Path) -> Callable[[Path], None]:
    base = stand_in_install_hook(deb, guest_config(), TPU_ENV, {})

    def hook(tree: Path) -> None:
        base(tree)
        install_debs(tree, [registry_deb])
        in_tree(tree, "/etc/docker/registry/config.yml").write_text(REGISTRY_CONFIG)
        # The guest's Python (bookworm's 3.11 still has crypt) makes the bcrypt line htpasswd would.
        line = chroot_run(tree, ["python3", "-W", "ignore", "-c", BCRYPT_SCRIPT, TOKEN])
        htpasswd = in_tree(tree, HTPASSWD)
        htpasswd.write_text(line)
        htpasswd.chmod(0o644)

    return hook


@pytest.fixture(scope="module")
def vm(vm_artifacts: Artifacts, vm_image_factory: ImageFactory, tpuboot_deb: Path) -> Iterator[VM]:
    (registry_deb,) = download_peers(cache_dir(), ("docker-registry",))
    image = vm_image_factory(install(tpuboot_deb, registry_deb), key="tpuboot-registry")
    with VM.from_artifacts(vm_artifacts, image, devices=["edu"], memory=1536, name="registry") as m:
        m.wait_booted()
        yield m


def serve_token(vm: VM, token: str | None) -> None:
    """The emulator serves ``token`` as the metadata server does (None: no service account)."""
    if token is None:
        vm.run(["python3", "-c", HTTP_SCRIPT, "DELETE", TOKEN_URL, ""], check=True)
        return
    answer = json.dumps({"access_token": token, "expires_in": 3599, "token_type": "Bearer"})
    vm.run(["python3", "-c", HTTP_SCRIPT, "PUT", TOKEN_URL, answer], check=True)


def registry_log(vm: VM) -> str:
    return vm.run("journalctl -b -u docker-registry -o cat", check=True).stdout


def anonymous_status(vm: VM) -> str:
    return vm.run(
        f"curl -s -o /dev/null -w '%{{http_code}}' http://{REGISTRY}/v2/tpuboot-test/vbar/manifests/1",
        check=True,
    ).stdout.strip()


def without_vbar(vm: VM) -> None:
    """tpuboot stopped, vBar's container and image gone from dockerd: the next start must pull."""
    vm.run(["systemctl", "stop", "tpuboot"], check=True, timeout=120)
    vm.run(f"docker rm -f {NAME} >/dev/null 2>&1; docker rmi {IMAGE} >/dev/null 2>&1; true", timeout=120)
    assert not vm.run(["docker", "image", "inspect", IMAGE], timeout=60).ok


def test_the_registry_takes_only_the_service_account_token(vm: VM) -> None:
    vm.wait_until(f"curl -s -o /dev/null http://{REGISTRY}/v2/", timeout=60, interval=0.5)
    serve_token(vm, TOKEN)
    vm.run(
        f'docker import --change \'CMD ["/bin/sh", "/vbar"]\' {VBAR_ROOTFS} {IMAGE} && '
        f"printf %s {TOKEN} | docker login -u oauth2accesstoken --password-stdin {REGISTRY} && "
        f"docker push {IMAGE} && docker logout {REGISTRY} && docker rmi {IMAGE}",
        check=True,
        timeout=300,
    )
    assert anonymous_status(vm) == "401"
    assert not vm.run(["docker", "image", "inspect", IMAGE], timeout=60).ok
    saved = vm.run("cat /root/.docker/config.json 2>/dev/null || echo '{}'", check=True).stdout
    assert not json.loads(saved).get("auths")  # the CLI kept no credentials; dockerd never reads them


def test_vbar_is_pulled_with_the_token_from_the_metadata_server(vm: VM) -> None:
    vm.write_file("/etc/tpuboot/tpuboot.yaml", CONFIG_ON)
    vm.run(["systemctl", "restart", "tpuboot"], check=True, timeout=120)
    wait_vbar_running(vm, timeout=120.0)
    image = vm.run(["docker", "inspect", "-f", "{{.Config.Image}}", NAME], check=True).stdout.strip()
    assert image == IMAGE
    journal = vm.journal("tpuboot")
    assert f"pulled {IMAGE} with the VM's service-account token" in journal
    users = {line for line in registry_log(vm).splitlines() if "auth.user.name=" in line}
    print("registry lines with a user:", len(users))
    assert any("auth.user.name=oauth2accesstoken" in line for line in users)
    # Never logged, never written: not in tpuboot's journal nor in any file tpuboot writes.
    assert TOKEN not in vm.run("journalctl -b -o cat", check=True, timeout=120).stdout
    found = vm.run(
        f"grep -rl -- {TOKEN} /etc/tpuboot /var/lib/tpuboot /run/tpuboot /home/tpu-runtime /etc/environment",
        timeout=60,
    )
    assert found.stdout == ""


def test_a_wrong_token_is_refused_with_the_fix_and_tpuboot_keeps_running(vm: VM) -> None:
    without_vbar(vm)
    serve_token(vm, WRONG_TOKEN)
    vm.run(["systemctl", "start", "tpuboot"], check=True, timeout=120)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'cannot pull image'", timeout=120)
    status = status_text(vm)
    print(status)
    assert f"cannot pull image {IMAGE} (2 tries: " in status
    assert "the registry refused the VM's service-account token: grant the service account" in status
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    assert "authentication failure" in registry_log(vm)


def test_without_a_token_the_pull_goes_anonymously_and_one_line_says_why(vm: VM) -> None:
    without_vbar(vm)
    serve_token(vm, None)
    vm.run(["systemctl", "start", "tpuboot"], check=True, timeout=120)
    vm.wait_until("systemctl show -P StatusText tpuboot | grep -q 'cannot pull image'", timeout=120)
    status = status_text(vm)
    print(status)
    assert (
        "pulled without credentials (no service-account token: the metadata server has no "
        "instance/service-accounts/default/token: the VM has no service account)"
    ) in status
    assert vm.run(["systemctl", "is-active", "tpuboot"]).stdout.strip() == "active"
    lines = vm.journal("tpuboot").splitlines()  # the earlier tests had a token: no such line
    said = [line for line in lines if "no service-account token for localhost:5000" in line]
    assert len(said) == 1, said  # two pull tries and the supervisor's next starts: one line
    assert said[0].endswith(f"; pulling {IMAGE} without credentials")


def test_once_the_token_is_back_vbar_starts_without_a_restart(vm: VM) -> None:
    pid = vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip()
    serve_token(vm, TOKEN)
    wait_vbar_running(vm, timeout=120.0)
    assert vm.run(["systemctl", "show", "-P", "MainPID", "tpuboot"], check=True).stdout.strip() == pid
    assert "service-account token available again for pulls from localhost:5000" in vm.journal(
        "tpuboot", lines=40
    )
