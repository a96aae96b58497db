"""examples/kubernetes/node-problem-detector.yaml: the objects NPD needs, each once; its rules are
tpuboot's table run through chroot into the host (what the DaemonSet mounts at /host); the
DaemonSet loads every config of its ConfigMap and may do what NPD does (RBAC)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tpuboot.checks import npd

EXAMPLE = Path(__file__).resolve().parents[3] / "examples/kubernetes/node-problem-detector.yaml"
NAME = "tpuboot-node-problem-detector"


def objects() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == sorted(set(kinds)), "an object twice"
    return {d["kind"]: d for d in docs}


def test_it_has_the_objects_npd_needs():
    found = objects()
    assert set(found) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"}
    assert all(o["metadata"]["name"] == NAME for o in found.values())


def test_its_rules_are_the_table_run_in_the_host_root():
    data = objects()["ConfigMap"]["data"]
    assert {name: json.loads(text) for name, text in data.items()} == npd.plugin_configs(npd.CHROOT)


def test_the_daemonset_loads_every_config_and_mounts_the_host_at_the_chroot():
    spec = objects()["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == NAME and spec["hostPID"] and spec["hostNetwork"]
    (container,) = spec["containers"]
    assert container["image"].startswith("registry.k8s.io/node-problem-detector/node-problem-detector:v")
    flags = dict(arg.split("=", 1) for arg in container["command"][1:] if "=" in arg)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    loaded = flags["--config.custom-plugin-monitor"].split(",")
    assert loaded == [f"{mounts['config']}/{name}" for name in npd.plugin_configs()]
    assert volumes["config"]["configMap"]["name"] == NAME
    assert mounts["host"] == npd.CHROOT[1] and volumes["host"]["hostPath"]["path"] == "/"
    assert container["securityContext"]["privileged"]  # chroot needs CAP_SYS_CHROOT; sysfs and /proc, root
    assert {e["name"] for e in container["env"]} == {"NODE_NAME"}


def test_rbac_grants_what_npd_does_to_its_service_account():
    found = objects()
    granted = {
        (resource, verb)
        for rule in found["ClusterRole"]["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {("nodes", "get"), ("nodes/status", "patch"), ("nodes/status", "update")}
    needed |= {("events", verb) for verb in ("create", "patch", "update")}
    assert needed <= granted
    binding = found["ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": NAME,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "kube-system"}]
