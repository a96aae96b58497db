"""Family cli: ``tpuboot bind DBDF`` against ``bind_to_vfio_pci.sh DBDF`` on one edu device.

The daemon stopped, the device unbound before each run, each command first in turn; guest
monotonic clock around the command. tpuboot runs twice over: with the bench's config (a device
rule for edu) and with the shipped, all-comments one (``--force``, as edu is then no TPU), which
is what an image without extra device rules runs. Then the interpreter's start-up and each import
step of ``tpuboot run`` are timed (and their RSS taken) in a fresh python3, best of 2, and 3
``tpuboot bind`` runs stamp their own imports and functions: where the time goes. Then bind ->
usable (``bind_guest.py usable``): ``tpuboot bind``, the script and ``driverctl set-override DBDF
vfio-pci`` run as root while a forked poller, already ``tester``, polls every 5 ms; until usable,
and until the command returns.
"""

from __future__ import annotations

from bench.guest import (
    BIND_SEGMENTS,
    PEER,
    SIDES,
    BenchError,
    check_usable,
    edu_addresses,
    helper,
    profile_segments,
    stop_tpuboot,
)
from bench.table import Report, median_ratio, ratio_row, spread
from harness.vm.machine import VM


def run_family(vm: VM, runs: int, report: Report) -> None:
    (address,) = edu_addresses(vm)
    stop_tpuboot(vm)
    data = helper(vm, "cli", address, "--runs", str(runs), timeout=600)
    if data["errors"]:
        raise BenchError(f"CLI runs failed: {data['errors']}")
    check_usable(vm, address)
    imports = helper(vm, "imports", timeout=300)["steps"]
    stamped = helper(vm, "profile", "bind", address, "--runs", "3", timeout=300)["runs"]
    times = data["times"]
    report.add(
        "cli",
        ratio_row(
            f"CLI bind: tpuboot vs bind_to_vfio_pci.sh (n={runs})", times["tpuboot"], times["baseline"], 1.5
        ),
    )
    report.add(
        "cli",
        ratio_row(
            "  the same with the shipped config (comments only: no yaml import)",
            times["tpuboot, shipped config"],
            times["baseline"],
        ),
    )
    report.add(
        "cli", ratio_row("  python3 -c pass | bash -c true", times["python3 -c pass"], times["bash -c true"])
    )
    imported = times["import tpuboot.cli"]
    report.add(
        "cli", ratio_row("  python3 -c 'import tpuboot.cli' | bash -c true", imported, times["bash -c true"])
    )
    total_s = sum(step["s"] for step in imports)
    cli_s = sum(step["s"] for step in imports[:3])  # interpreter, yaml, rest of tpuboot.cli
    report.note(
        "cli",
        "start-up of a fresh python3, step by step (best of 2; +wall, +RSS): "
        + "; ".join(f"{s['step']} +{s['s'] * 1000:.0f} ms +{s['rss_kib'] / 1024:.1f} MiB" for s in imports)
        + f". `tpuboot bind` pays the first three ({cli_s:.2f} s; yaml only for a config that sets "
        f"something), `tpuboot run` all ({total_s:.2f} s)",
    )
    report.note(
        "cli", "`tpuboot bind` stamped inside (median of 3): " + profile_segments(stamped, BIND_SEGMENTS)
    )
    report.note(
        "cli",
        "the bench config's parse was "
        + (
            "taken from /var/cache/tpuboot/config.json in the timed runs (PyYAML not imported)"
            if data.get("config_cached")
            else "NOT cached: every timed run imported PyYAML"
        ),
    )
    usable = helper(vm, "usable", address, "--runs", str(runs), timeout=900)
    if usable["errors"]:
        raise BenchError(f"bind-until-usable runs failed: {usable['errors']}")
    for key, metric in (
        (
            "usable_s",
            f"CLI bind -> usable by tester: tpuboot bind | script | driverctl set-override (n={runs})",
        ),
        ("command_s", "  the same, until the command returns"),
    ):
        values = {side: [r[key] for r in usable["runs"][side]] for side in SIDES}
        ours, peer = values["tpuboot"], values[PEER]
        row = ratio_row(metric, ours, values["baseline"])
        report.add("cli", row.against(PEER, spread(peer), median_ratio(ours, peer), 1.0))
    report.note(
        "cli",
        "bind -> usable: each command run as root while a forked poller, already tester, polls (5 ms) "
        "until the VFIO read succeeds; driverctl with its rules armed and the udev mode rule, the others "
        "with driverctl's rules masked",
    )
    report.raw["cli"] = {"address": address, **data, "imports": imports, "stamped": stamped, "usable": usable}
