"""tpuboot's benchmarks in one run, each against its baseline and its peer measured in the same run.

Binding and start-up against the documented udev rule + shell handler and cloud-init script, on
a real kernel; idle cost against a sleeping python3; the metadata client against the documented
fetch made to retry. The peers, the tools people already run for these jobs (``bench/peers.py``,
Debian's packages in the same guests, never active beside tpuboot): ``driverctl`` for binding
(by hand, its saved overrides at boot and on hot add), ``google-guest-agent`` for the idle
footprint. Usage, from the repository root (root is needed for the image build and QEMU)::

    sudo .venv/bin/python -m bench.run [--json FILE] [--markdown FILE]
                                       [--only hotplug,cdi,coldplug,cli,icount,idle,fleet,holders,slice]
                                       [--reps 6] [--coldplug-reps 5] [--cli-runs 10]
                                       [--icount-runs 5]

About 7 minutes with warm caches (.cache/vm), more while other QEMU guests share the host: the
.deb and one guest image are built, then one QEMU guest (TCG, 2 vCPUs) per scenario family, and
the fleet, holders and slice families run on the host after the last guest is gone.

One module per family, whose docstring says how it times and against what, each with a
``run_family`` that adds its rows to the report (``bench/table.py``): ``bench/hotplug.py``,
``bench/cdi.py``, ``bench/coldplug.py``, ``bench/cli.py``, ``bench/icount.py`` (the cli and
coldplug commands in a guest whose clock counts instructions), ``bench/idle.py``,
``bench/fleet.py`` (64 simulated hosts against one failing metadata server emulator),
``bench/holders.py`` (``tpuboot who`` against ``fuser -v`` and ``lsof``) and ``bench/slice_sweep.py``
(the slice's peer sweep against a serial one, in network namespaces). ``bench/guest.py``
drives the guest and arms one side at a time; the guest side is ``bench/in_guest/``
(``bind_guest.py`` and its modules).

Benchmarks print figures; they are not assertions and pytest does not collect them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import cdi, cli, coldplug, fleet, holders, hotplug, icount, peers, slice_sweep
from bench.guest import HostLoad, bench_install_hook, booted, tree_revision
from bench.icount import IcountVM
from bench.idle import IdleFamily, idle_install_hook
from bench.table import FAMILIES, Report, markdown_table, print_table
from harness.vm.accel import select_accel
from harness.vm.artifacts import (
    build_image,
    ensure_artifacts,
    remove_tree,
)
from harness.vm.hostenv import cache_dir
from harness.vm.machine import VM
from harness.vm.tpuboot_guest import (
    build_deb,
    package_install_hook,
)

log = logging.getLogger("bench.bind")

VM_FAMILIES = ("hotplug", "cdi", "coldplug", "cli", "icount", "idle")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description="tpuboot's benchmarks, each against its baseline, in one run."
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="FILE", help="also write the table as Markdown to FILE"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--only", default=",".join(FAMILIES), help=f"families to run (default {','.join(FAMILIES)})"
    )
    parser.add_argument("--reps", type=int, default=6, help="hotplug adds per side (default 6)")
    parser.add_argument("--coldplug-reps", type=int, default=5, help="coldplug runs per side (default 5)")
    parser.add_argument("--cli-runs", type=int, default=10, help="CLI runs per side (default 10)")
    parser.add_argument("--icount-runs", type=int, default=5, help="icount guest runs per side (default 5)")
    parser.add_argument("--idle-window", type=float, default=60.0, help="idle window in s (default 60)")
    args = parser.parse_args(argv)
    args.families = [f.strip() for f in args.only.split(",") if f.strip()]
    if unknown := set(args.families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    started = time.monotonic()

    def probe(kernel: Any, initrd: Path) -> None:  # overlaps the KVM/TCG probe with the builds
        threading.Thread(target=select_accel, args=(kernel.boot_image, initrd), daemon=True).start()

    report = Report()
    crowd: dict[str, float] = {}
    revision = tree_revision()
    if set(args.families) & set(VM_FAMILIES):
        run_guests(args, report, crowd, probe)
    if "fleet" in args.families:  # on the host, after the last guest is gone
        t, load = time.monotonic(), HostLoad()
        fleet.run_family(report)
        crowd["fleet"] = round(load.others_cores(), 2)
        log.info("fleet: measured in %.0f s", time.monotonic() - t)
    if "holders" in args.families:
        t, load = time.monotonic(), HostLoad()
        holders.run_family(report)
        crowd["holders"] = round(load.others_cores(), 2)
        log.info("holders: measured in %.0f s", time.monotonic() - t)
    if "slice" in args.families:
        t, load = time.monotonic(), HostLoad()
        slice_sweep.run_family(report)
        crowd["slice"] = round(load.others_cores(), 2)
        log.info("slice: measured in %.0f s", time.monotonic() - t)
    report.raw["total_s"] = time.monotonic() - started
    report.raw["revision"] = revision
    report.raw["host_cores_used_by_others"] = crowd
    print_table(report)
    if crowd:
        load = ", ".join(f"{name} {cores:.2f}" for name, cores in crowd.items())
        print(f"* host: cores kept busy by other processes while measuring (of {os.cpu_count()}): {load}")
    print(f"\ntpuboot {revision}; total {report.raw['total_s']:.0f} s")
    if args.json:
        payload = {
            "rows": {f: [asdict(r) for r in rows] for f, rows in report.rows.items()},
            "notes": report.notes,
            "raw": report.raw,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown_table(report))
    return 0


def run_guests(
    args: argparse.Namespace, report: Report, crowd: dict[str, float], probe: Callable[[Any, Path], None]
) -> None:
    """Families 1-4: one .deb, one guest image, one guest per family (idle's in the background)."""
    artifacts = ensure_artifacts(on_boot_files=probe)
    work = Path(tempfile.mkdtemp(prefix="bindbench-", dir=cache_dir()))
    measures: dict[str, tuple[dict[str, Any], Callable[[VM], None]]] = {
        "hotplug": ({"hotplug_ports": 1}, lambda vm: hotplug.run_family(vm, args.reps, report)),
        "cdi": ({"hotplug_ports": 1}, lambda vm: cdi.run_family(vm, args.reps, report)),
        "coldplug": (
            {"devices": ["edu"] * 8},
            lambda vm: coldplug.run_family(vm, args.coldplug_reps, report),
        ),
        "cli": ({"devices": ["edu"]}, lambda vm: cli.run_family(vm, args.cli_runs, report)),
        "icount": (
            {"devices": ["edu"] * 8, "smp": 1, "vm_class": IcountVM, "boot_timeout": 900},
            lambda vm: icount.run_family(vm, args.icount_runs, report),
        ),
    }
    idle: IdleFamily | None = None
    try:
        deb = build_deb(work / "deb")
        peer_debs = peers.download_peers(cache_dir())
        versions = {d.name.split("_")[0]: peers.deb_version(d) for d in peer_debs}
        report.raw["peers"] = versions
        report.note("hotplug", "peers: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
        hook = bench_install_hook(package_install_hook(deb), peer_debs)
        image = build_image(artifacts, work / "bindbench.ext4", hook)
        if "idle" in args.families:
            hook = bench_install_hook(idle_install_hook(deb), peer_debs)
            vbar_image = build_image(artifacts, work / "bindbench-vbar.ext4", hook)
            idle = IdleFamily(artifacts, vbar_image, args.idle_window)
            idle.start()
        for name in (f for f in VM_FAMILIES if f in args.families and f != "idle"):
            kwargs, measure = measures[name]
            with booted(artifacts, image, name, **kwargs) as vm:
                if idle is not None:
                    idle.finish(report)  # no timing while the idle window runs
                t, load = time.monotonic(), HostLoad()
                measure(vm)
                crowd[name] = round(load.others_cores(), 2)
                log.info("%s: measured in %.0f s", name, time.monotonic() - t)
        if idle is not None:
            idle.finish(report)
    finally:
        if idle is not None:
            idle.close()
        remove_tree(work)


if __name__ == "__main__":
    sys.exit(main())
