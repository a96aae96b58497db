"""Family coldplug: 8 edu devices present at boot, unbound (no driver, no override) before each rep.

Guest clock, from the start of ``systemctl start tpuboot`` (returns at READY: Type=notify, i.e.
the 8 bound and tpu-env written) or of the baseline's boot job (``udevadm trigger --settle
--action=add --subsystem-match=pci``, what it does at boot, returning once those events, handler
included, are done; then the documented cloud-init ``configure-env-vars.sh``: curl tpu-env from
the metadata server, YAML to ``KEY="value"`` lines) until all 8 are usable (10 ms poll, as
tester), and until the command returns ("start -> READY"). The daemon is stopped before the clock
starts. tpuboot's journal splits its start: exec -> first "bound" line -> READY. After the timed
reps, one ``tpuboot run`` started by hand (no sandbox, no systemd) stamps its own imports and
functions (``bind_guest.py profile``): where the start-up time goes.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Sequence
from typing import Any

from bench.guest import (
    BENCH_LIBEXEC,
    PEER,
    RUN_SEGMENTS,
    SIDES,
    BenchError,
    baseline_rule,
    check_usable,
    driverctl_armed,
    edu_addresses,
    helper,
    profile_segments,
    stop_tpuboot,
    unbind_all,
    unit_properties,
)
from bench.table import Report, median, median_ratio, ratio_row, spread
from harness.vm.machine import VM

log = logging.getLogger("bench.bind")

ENV_SCRIPT = f"{BENCH_LIBEXEC}/configure-env-vars.sh"
TPU_ENV_FILE = "/home/tpu-runtime/tpu-env"
COLDPLUG_COMMANDS = {  # shell words for bind_guest.py's --command
    "tpuboot": "systemctl start tpuboot",
    # The baseline's boot job: the udev coldplug trigger, then the documented cloud-init script.
    "baseline": shlex.join(
        [
            "sh",
            "-c",
            f"udevadm trigger --settle --action=add --subsystem-match=pci && {ENV_SCRIPT} >/dev/null",
        ]
    ),
    # driverctl's boot job: the same trigger; its rule starts driverctl@pci-DBDF.service per saved
    # override (asynchronously: the poll, not the command, says when all 8 are usable). No tpu-env.
    PEER: "udevadm trigger --settle --action=add --subsystem-match=pci",
}


def tpuboot_start_split(vm: VM) -> dict[str, float]:
    """From the journal of tpuboot's last start: exec -> first/last device bound -> READY (s)."""
    props = unit_properties(
        vm, "InvocationID", "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic"
    )
    out = vm.run(["journalctl", f"_SYSTEMD_INVOCATION_ID={props['InvocationID']}", "-o", "json"], check=True)
    bound = [
        int(entry["__MONOTONIC_TIMESTAMP"])
        for line in out.stdout.splitlines()
        if "bound to vfio-pci" in (entry := json.loads(line)).get("MESSAGE", "")
    ]
    if not bound:
        return {}
    exec_us = int(props["ExecMainStartTimestampMonotonic"])
    return {
        "exec_to_first_bound_s": (min(bound) - exec_us) / 1e6,
        "first_to_last_bound_s": (max(bound) - min(bound)) / 1e6,
        "exec_to_ready_s": (int(props["ActiveEnterTimestampMonotonic"]) - exec_us) / 1e6,
    }


def coldplug_reps(
    vm: VM, addresses: Sequence[str], reps: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``reps`` rounds of each side from all unbound; the reps, and any redone because a device
    was bound again before the start."""
    results: list[dict[str, Any]] = []
    rebound: list[dict[str, Any]] = []
    for i in range(reps):
        for side in SIDES[i % len(SIDES) :] + SIDES[: i % len(SIDES)]:  # each first in turn
            for _attempt in range(3):
                # Unbound with no binder armed and udev idle, then the side armed: a clean start.
                stop_tpuboot(vm)
                baseline_rule(vm, False)
                driverctl_armed(vm, False)
                unbind_all(vm, addresses)
                vm.run(["rm", "-f", TPU_ENV_FILE], check=True)  # each side must write it afresh
                vm.run(["udevadm", "settle", "--timeout=60"], timeout=90)
                baseline_rule(vm, side == "baseline")
                if side == PEER:
                    driverctl_armed(vm, True, addresses)
                command = COLDPLUG_COMMANDS[side]
                data = helper(vm, "coldplug", *addresses, "--command", command, timeout=120)
                if not data["bound_at_start"]:
                    break
                log.warning(
                    "coldplug %s: %s bound again before the start; again", side, data["bound_at_start"]
                )
                rebound.append({"side": side, "rep": i, "bound": data["bound_at_start"]})
            else:
                raise BenchError(f"coldplug {side}: devices keep coming back bound: {rebound}")
            data["side"] = side
            written = vm.run(["grep", "-c", "^[A-Z_]*=", TPU_ENV_FILE]).stdout.strip()
            if side != PEER and (not written.isdigit() or int(written) == 0):
                raise BenchError(f"coldplug {side}: {TPU_ENV_FILE} not written\n{data.get('stderr', '')}")
            if side == "tpuboot":
                data["split"] = tpuboot_start_split(vm)
            results.append(data)
            log.info(
                "coldplug %s: command %.3f s, all usable %.3f s",
                side,
                data["command_s"],
                data["all_usable_s"],
            )
    return results, rebound


def run_family(vm: VM, reps: int, report: Report) -> None:
    addresses = edu_addresses(vm)
    if len(addresses) != 8:
        raise BenchError(f"expected 8 edu devices, the guest has {addresses}")
    check_usable(vm, addresses[0])
    results, rebound = coldplug_reps(vm, addresses, reps)
    status = vm.run(["systemctl", "show", "-P", "StatusText", "tpuboot"]).stdout.strip()

    def per_side(key: str) -> dict[str, list[float]]:
        return {s: [r[key] for r in results if r["side"] == s and r[key] is not None] for s in SIDES}

    usable, done = per_side("all_usable_s"), per_side("command_s")
    row = ratio_row(
        f"coldplug 8: start -> all 8 usable (n={reps})", usable["tpuboot"], usable["baseline"], 0.5
    )
    report.add(
        "coldplug",
        row.against(PEER, spread(usable[PEER]), median_ratio(usable["tpuboot"], usable[PEER]), 1.0),
    )
    report.add(
        "coldplug",
        ratio_row(
            f"daemon start -> READY: 8 bound, tpu-env written (n={reps}) | trigger --settle + env script",
            done["tpuboot"],
            done["baseline"],
        ),
    )
    splits = [r["split"] for r in results if r.get("split")]
    if splits:
        first = median([s["exec_to_first_bound_s"] for s in splits])
        spanned = median([s["first_to_last_bound_s"] for s in splits])
        ready = median([s["exec_to_ready_s"] for s in splits])
        report.note(
            "coldplug",
            f"tpuboot's journal, medians: exec -> first 'bound' line logged {first:.3f} s, first -> last "
            f"of 8 logged {spanned:.3f} s (binds started before the daemon loaded log their result once it "
            f"has), exec -> READY {ready:.3f} s",
        )
    report.note(
        "coldplug",
        f"driverctl: `udevadm trigger --settle` returned after {spread(done[PEER])}; its "
        "driverctl@.service units bind after that, and it writes no tpu-env",
    )
    stop_tpuboot(vm)
    baseline_rule(vm, False)
    driverctl_armed(vm, False)
    metadata_env = unit_properties(vm, "Environment")["Environment"].split()
    env_args = [arg for item in metadata_env for arg in ("--env", item)]
    stamped = helper(vm, "profile", "run", *addresses, *env_args, timeout=120)["runs"]
    report.note(
        "coldplug",
        "`tpuboot run` stamped inside (outside systemd's sandbox, after the timed reps): "
        + profile_segments(stamped, RUN_SEGMENTS),
    )
    if rebound:
        report.note("coldplug", f"devices found bound again between unbind and start (rep redone): {rebound}")
    firsts = [min(r["usable_s"].values()) for r in results if r["side"] == "baseline"]
    report.note("coldplug", f"baseline: first of 8 usable after {spread(firsts)}")
    report.raw["coldplug"] = {
        "addresses": addresses,
        "reps": results,
        "rebound": rebound,
        "status": status,
        "stamped": stamped,
    }
