"""PCIe health of one PCI function, as the kernel reports it in sysfs.

Nothing on a TPU host watches a chip degrade: GKE's device plugin and the TPU DRA driver call a
chip healthy when its node exists. The kernel already knows more for every function: the link it
trained at against the one it can do (``current_link_*`` / ``max_link_*``), the AER error counters
since boot (``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``:
Documentation/ABI/testing/sysfs-bus-pci-devices-aer), the reset methods it offers
(``reset_method``, Linux 5.15+), and whether the function still answers at all (a vendor id of
0xffff in config space: it fell off the bus). Reading these costs a few small sysfs reads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from tpuboot.devices.pci import PCI_DEVICES, is_function_name
from tpuboot.kernelfiles import read_text
from tpuboot.numbers import ascii_decimal, ascii_int
from tpuboot.paths import Root

#: The AER counter files, by the severity they count.
AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}
#: A root port's totals of the error messages it received from below it. The kernel counts a
#: fatal error in the endpoint's own file only when it can still read the endpoint's status
#: (Linux 6.1 does not try after a fatal one: "type=Inaccessible"), but always here.
PORT_FILES = {
    "correctable": "aer_rootport_total_err_cor",
    "nonfatal": "aer_rootport_total_err_nonfatal",
    "fatal": "aer_rootport_total_err_fatal",
}
#: A link at this fraction of its maximum bandwidth or less is a failure, not just a doubt: a
#: chip trained at x8 of x16, or one PCIe generation down, moves data at half the rate.
FAIL_FRACTION = 0.5
_SPEED = re.compile(r"([0-9.]+) GT/s(?: PCIe)?")
_ABSENT_VENDOR = b"\xff\xff"


def _encoding(gts: float) -> float:
    """Payload share of the line rate: 8b/10b up to 5 GT/s (PCIe 1 and 2), 128b/130b from 8 GT/s;
    PCIe 6's FLIT mode is close enough to 128b/130b for a ratio."""
    return 0.8 if gts <= 5.0 else 128 / 130


@dataclass(frozen=True)
class Link:
    """The link a function trained at, and the best it can do; None where sysfs does not say."""

    speed: float | None  # GT/s
    width: int | None  # lanes
    max_speed: float | None
    max_width: int | None

    @property
    def fraction(self) -> float | None:
        """Current bandwidth over the maximum's (1.0: as good as it gets); None if unknown."""
        if None in (self.speed, self.width, self.max_speed, self.max_width):
            return None
        assert self.speed is not None and self.width is not None  # for mypy: checked above
        assert self.max_speed is not None and self.max_width is not None
        best = self.max_speed * _encoding(self.max_speed) * self.max_width
        if best <= 0:
            return None
        return self.speed * _encoding(self.speed) * self.width / best

    @property
    def degraded(self) -> bool:
        fraction = self.fraction
        return fraction is not None and fraction < 1.0

    def __str__(self) -> str:
        def side(speed: float | None, width: int | None) -> str:
            shown = "?" if speed is None else f"{speed:g} GT/s"
            return f"{shown} x{'?' if width is None else width}"

        return f"{side(self.speed, self.width)} of {side(self.max_speed, self.max_width)}"


@dataclass(frozen=True)
class Health:
    """One function's PCIe health. ``aer`` maps a severity to its counters by name (the kernel's
    names, ``TOTAL_ERR_*`` included); a severity without a file (no AER capability) is absent."""

    address: str
    present: bool  # config space readable and not all ones
    link: Link | None  # None: not a PCIe function, or the link files are missing
    aer: dict[str, dict[str, int]] = field(default_factory=dict)
    reset_methods: tuple[str, ...] = ()
    port: str | None = None  # the root port right above it, when nothing else sits below that port
    port_errors: dict[str, int] = field(default_factory=dict)  # what that port received, by severity
    reset_baseline: dict[str, int] = field(default_factory=dict)  # errors() at its last good reset

    def since_reset(self, severity: str) -> int | None:
        """:meth:`errors` since the last reset that brought the chip back (since boot without
        one): the errors a reset cleared up are history, and the root port's totals never drop."""
        now = self.errors(severity)
        before = self.reset_baseline.get(severity, 0)
        if now is None:
            return None
        return now - before if now >= before else now  # lower: the counters started again

    def _own(self, severity: str) -> int | None:
        """The function's own count of one severity: its TOTAL_ERR line, else the sum."""
        counters = self.aer.get(severity)
        if counters is None:
            return None
        total = next((v for k, v in counters.items() if k.startswith("TOTAL_ERR")), None)
        return total if total is not None else sum(counters.values())

    def _from_port(self, severity: str) -> bool:
        """Whether the root port's count is the one to believe (larger, or the only one)."""
        own, port = self._own(severity), self.port_errors.get(severity)
        return port is not None and (own is None or port > own)

    def errors(self, severity: str) -> int | None:
        """The errors of one severity since boot, the function's own count or, when larger, what
        its root port received (from it alone); None when the kernel keeps neither."""
        return self.port_errors[severity] if self._from_port(severity) else self._own(severity)

    def since(self) -> str:
        return "since its last reset" if self.reset_baseline else "since boot"

    def origin(self, severity: str) -> str:
        """Where :meth:`errors` counted them, for a message: "" (the function's own counters)."""
        return f" (as its root port {self.port} received them)" if self._from_port(severity) else ""

    def as_dict(self) -> dict[str, object]:
        link = self.link
        return {
            "address": self.address,
            "present": self.present,
            "link": None
            if link is None
            else {
                "speed_gts": link.speed,
                "width": link.width,
                "max_speed_gts": link.max_speed,
                "max_width": link.max_width,
                "fraction": link.fraction,
            },
            "aer": self.aer,
            "aer_totals": {severity: self.errors(severity) for severity in AER_FILES},
            "root_port": self.port,
            "root_port_errors": self.port_errors,
            "reset_methods": list(self.reset_methods),
        }


def _read(root: Root, address: str, name: str) -> str | None:
    """One sysfs attribute of ``address``; None when absent or unreadable (EIO from a function
    that fell off the bus, EINVAL from a link that is down), not a file, or past the size bound."""
    return read_text(root, f"{PCI_DEVICES}/{address}/{name}")


def parse_speed(text: str | None) -> float | None:
    """``8.0 GT/s PCIe`` (Linux 5.x+) or ``8 GT/s`` (older) in GT/s; None for ``Unknown`` and
    anything else the kernel does not write (numbers: :mod:`tpuboot.numbers`)."""
    match = _SPEED.fullmatch((text or "").rstrip("\n"))
    return ascii_decimal(match[1]) if match else None


def parse_width(text: str | None) -> int | None:
    """A lane count (or a root port's error total) as the kernel writes it, ASCII digits and a
    newline; 0 (link down) counts, anything else is None."""
    return ascii_int((text or "").rstrip("\n"))


#: The width the kernel writes when the link status register says nothing (PCIE_LNK_WIDTH_UNKNOWN),
#: as it may just after an error: no lane count.
UNKNOWN_WIDTH = 255


def parse_lanes(text: str | None) -> int | None:
    """A link's lane count; None where the kernel says it does not know it (x255)."""
    width = parse_width(text)
    return None if width == UNKNOWN_WIDTH else width


def parse_aer(text: str) -> dict[str, int]:
    """``NAME COUNT`` lines as a mapping; a line of another shape is skipped, not trusted."""
    counters = {}
    for line in text.splitlines():
        name, _, count = line.rpartition(" ")  # a name may hold a space ("Bad TLP"), a count none
        value = ascii_int(count)
        if name and name == name.strip() and value is not None:
            counters[name] = value
    return counters


def read_link(root: Root, address: str) -> Link | None:
    texts = [_read(root, address, f) for f in ("current_link_speed", "current_link_width")]
    maxima = [_read(root, address, f) for f in ("max_link_speed", "max_link_width")]
    if all(t is None for t in (*texts, *maxima)):
        return None
    return Link(parse_speed(texts[0]), parse_lanes(texts[1]), parse_speed(maxima[0]), parse_lanes(maxima[1]))


def is_present(root: Root, address: str) -> bool:
    """The function answers config reads with a real vendor id (0xffff: gone from the bus)."""
    try:
        with open(root.path(f"{PCI_DEVICES}/{address}/config"), "rb") as f:
            vendor = f.read(2)
    except OSError:
        return False
    return len(vendor) == 2 and vendor != _ABSENT_VENDOR


def sole_port(root: Root, address: str) -> str | None:
    """The root port directly above ``address`` when its functions are the only ones below it
    (so what the port received came from this chip); None otherwise, or when not behind one."""
    try:
        target = os.readlink(root.path(f"{PCI_DEVICES}/{address}", follow=False))
    except OSError:
        return None
    parts = target.split("/")
    if len(parts) < 2 or not is_function_name(parts[-2]):
        return None
    port = parts[-2]
    try:
        below = [n for n in os.listdir(root.path(f"{PCI_DEVICES}/{port}")) if is_function_name(n)]
    except OSError:
        return None
    base = address.rpartition(".")[0]
    if not all(n.rpartition(".")[0] == base for n in below):
        return None
    return port if _read(root, port, PORT_FILES["fatal"]) is not None else None


def _port_errors(root: Root, port: str | None) -> dict[str, int]:
    if port is None:
        return {}
    found = {}
    for severity, name in PORT_FILES.items():
        count = parse_width(_read(root, port, name))  # one whole number, as a width is
        if count is not None:
            found[severity] = count
    return found


#: The error counts at each function's last reset that brought its chip back (tpuboot reset
#: writes it); under /run, as the kernel's counters, it starts again at every boot.
BASELINE_PATH = "/run/tpuboot/aer-baseline.json"


def load_baselines(root: Root) -> dict[str, dict[str, int]]:
    """{address: {severity: count}}; {} when there is none or it is damaged (nothing is hidden)."""
    from tpuboot.atomicfile import FileReadError, read_file

    try:
        data = json.loads(read_file(root, BASELINE_PATH) or b"{}")
    except (FileReadError, ValueError, RecursionError):  # RecursionError: "[[[[..." nested deep
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(a): {str(k): v for k, v in counts.items() if _count(v)}
        for a, counts in data.items()
        if isinstance(counts, dict)
    }


def _count(value: object) -> bool:
    """An error count as tpuboot writes one: a whole number from 0 to 2**64 (not a bool, not huge)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


def save_baseline(root: Root, healths: list[Health]) -> None:
    """After a reset brought a chip back: its functions' counts now are where its errors start."""
    from tpuboot.atomicfile import write_file

    data = load_baselines(root)
    for h in healths:
        data[h.address] = {s: n for s in AER_FILES if (n := h.errors(s)) is not None}
    write_file(root, BASELINE_PATH, json.dumps(data, sort_keys=True).encode(), mode=0o644)


def read_health(root: Root, address: str, baselines: dict[str, dict[str, int]] | None = None) -> Health:
    """One function's health; ``baselines`` (default: read now) from :func:`load_baselines`."""
    aer = {}
    for severity, name in AER_FILES.items():
        text = _read(root, address, name)
        if text is not None:
            aer[severity] = parse_aer(text)
    methods = tuple((_read(root, address, "reset_method") or "").split())
    port = sole_port(root, address)
    link = read_link(root, address)
    baseline = (load_baselines(root) if baselines is None else baselines).get(address, {})
    present = is_present(root, address)
    return Health(address, present, link, aer, methods, port, _port_errors(root, port), baseline)


def read_healths(root: Root, addresses: Iterable[str]) -> dict[str, Health]:
    """Each function's health by address, the baselines read once for all of them."""
    baselines = load_baselines(root)
    return {address: read_health(root, address, baselines) for address in addresses}


@dataclass(frozen=True)
class Finding:
    """What one function's health means for its chip: ``level`` FAIL or WARN, and why; ``kind``
    names it in a word (:data:`KINDS`), for a summary."""

    level: str
    detail: str
    fix: str
    kind: str


#: Each kind of finding, in the order a summary lists them.
KINDS = ("lost", "fatal", "nonfatal", "degraded")


def summary(healths: Iterable[Health]) -> str:
    """The functions' PCIe state in one word, for the ``tpus`` guest attribute: ``ok``, or how many
    functions have each kind of finding (``fatal:1,degraded:2``)."""
    counts = {kind: 0 for kind in KINDS}
    for health in healths:
        for kind in {finding.kind for finding in judge(health)}:
            counts[kind] += 1
    shown = [f"{kind}:{n}" for kind, n in counts.items() if n]
    return ",".join(shown) or "ok"


def judge(health: Health) -> list[Finding]:
    """The doubts and failures in one function's health; [] when it is well."""
    a = health.address
    if not health.present:
        return [
            Finding(
                "FAIL",
                f"{a} does not answer config reads (vendor id 0xffff): it fell off the bus",
                "stop the VM and start it again (a function that does not answer cannot be rebound)",
                "lost",
            )
        ]
    found = []
    fatal = health.since_reset("fatal")
    if fatal:
        found.append(
            Finding(
                "FAIL",
                f"{a} logged {fatal} fatal PCIe error(s) {health.since()}{health.origin('fatal')}",
                f"once no job uses it, `tpuboot unbind {a} && tpuboot bind {a}`; "
                "if errors go on, stop and start the VM",
                "fatal",
            )
        )
    nonfatal = health.since_reset("nonfatal")
    if nonfatal:
        found.append(
            Finding(
                "WARN",
                f"{a} logged {nonfatal} non-fatal PCIe error(s) {health.since()}{health.origin('nonfatal')}",
                "watch the count (`tpuboot status --json`): a rising one comes before a failing chip",
                "nonfatal",
            )
        )
    link = health.link
    if link is not None and link.degraded:
        fraction = link.fraction or 0.0
        level = "FAIL" if fraction <= FAIL_FRACTION else "WARN"
        found.append(
            Finding(
                level,
                f"{a} link trained at {link} ({fraction:.0%} of its bandwidth)",
                "stop the VM and start it again (a new host retrains the link); report it if it recurs",
                "degraded",
            )
        )
    return found
