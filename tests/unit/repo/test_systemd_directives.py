"""Every directive in the unit and drop-ins tpuboot ships exists in systemd 249 (Ubuntu 22.04).

systemd ignores a directive it does not know with a log line and starts the unit anyway: a
sandboxing option newer than the system's systemd silently leaves the service less confined.
So each directive (and each value that came later than its directive) is listed here with the
systemd release that introduced it, and the test fails on one newer than 249 or one not listed.

Versions are from systemd's NEWS (the copy Debian 12's systemd 252 ships,
/usr/share/doc/systemd/NEWS.gz, which runs from release 38): "CHANGES WITH N" is the release
whose notes announce the directive or value. Some directives predate NEWS: for those whose notes
first mention them as existing, that release is given (an upper bound, which is all a check
against 249 needs); FIRST are those of systemd's first releases (2010), before NEWS began.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

TOP = Path(__file__).resolve().parents[3]
OLDEST_SUPPORTED = 249  # Ubuntu 22.04; Ubuntu 24.04 has 255, Debian 12 252, Debian 13 257
FIRST = 1

# (section, directive) -> the systemd release that introduced it.
DIRECTIVES: dict[tuple[str, str], int] = {
    ("Unit", "Description"): FIRST,
    ("Unit", "Documentation"): 183,  # NEWS 183: "We introduced the Documentation= field"
    ("Unit", "DefaultDependencies"): FIRST,
    ("Unit", "After"): FIRST,
    ("Unit", "Before"): FIRST,
    ("Unit", "Wants"): FIRST,
    ("Unit", "Conflicts"): FIRST,
    # NEWS 229: StartLimitBurst=, StartLimitInterval= ... moved from [Service] to [Unit], where
    # the interval is StartLimitIntervalSec=.
    ("Unit", "StartLimitIntervalSec"): 229,
    ("Unit", "StartLimitBurst"): 229,
    ("Service", "Type"): FIRST,
    ("Service", "NotifyAccess"): 233,  # NEWS 233 adds the value "exec": the setting is older
    ("Service", "ExecStart"): FIRST,
    ("Service", "Restart"): FIRST,
    ("Service", "RestartSec"): FIRST,
    ("Service", "WatchdogSec"): 207,  # NEWS 207 (Restart=on-watchdog) presupposes it
    ("Service", "TimeoutStartSec"): 188,  # NEWS 188: TimeoutSec= split into Start and Stop
    ("Service", "TimeoutStopSec"): 188,
    ("Service", "CapabilityBoundingSet"): 183,  # NEWS 183 (system-wide one "now" too)
    ("Service", "NoNewPrivileges"): 227,  # NEWS 227: settable on transient units, so older
    ("Service", "ProtectSystem"): 214,  # NEWS 214: "Two new service settings"
    ("Service", "ProtectHome"): 214,
    ("Service", "ReadWritePaths"): 231,  # NEWS 231: ReadWriteDirectories= renamed
    ("Service", "BindPaths"): 233,  # NEWS 233: "gained new BindPaths="
    ("Service", "StateDirectory"): 235,  # NEWS 235
    ("Service", "CacheDirectory"): 235,  # NEWS 235: "StateDirectory=, CacheDirectory=, ..."
    ("Service", "LogsDirectory"): 235,  # NEWS 235: "... LogsDirectory=, ConfigurationDirectory="
    ("Service", "RuntimeDirectory"): 211,  # NEWS 211: "new RuntimeDirectory= setting"
    ("Service", "RuntimeDirectoryPreserve"): 235,  # NEWS 235
    ("Service", "PrivateTmp"): 183,  # NEWS 183: "now affects both /tmp and /var/tmp"
    ("Service", "PrivateMounts"): 239,  # NEWS 239
    ("Service", "ProtectKernelTunables"): 232,  # NEWS 232
    ("Service", "ProtectKernelModules"): 232,
    ("Service", "ProtectKernelLogs"): 244,  # NEWS 244
    ("Service", "ProtectControlGroups"): 232,
    ("Service", "ProtectClock"): 245,  # NEWS 245
    ("Service", "ProtectHostname"): 242,  # NEWS 242
    ("Service", "ProtectProc"): 247,  # NEWS 247: ProtectProc= and ProcSubset=
    ("Service", "DevicePolicy"): 212,  # NEWS 212 (PrivateDevices= implies DevicePolicy=closed)
    ("Service", "RestrictAddressFamilies"): 211,  # NEWS 211
    ("Service", "IPAddressDeny"): 235,  # NEWS 235
    ("Service", "IPAddressAllow"): 235,
    ("Service", "SystemCallArchitectures"): 209,  # NEWS 209
    ("Service", "SystemCallFilter"): 187,  # NEWS 187 (as "SystemCallFilters=", a typo there)
    ("Service", "SystemCallErrorNumber"): 209,  # NEWS 209
    ("Service", "RestrictNamespaces"): 233,  # NEWS 233
    ("Service", "RestrictRealtime"): 231,  # NEWS 231
    ("Service", "RestrictSUIDSGID"): 242,  # NEWS 242
    ("Service", "LockPersonality"): 235,  # NEWS 235
    ("Service", "MemoryDenyWriteExecute"): 231,  # NEWS 231
    ("Service", "UMask"): FIRST,
    ("Service", "LimitMEMLOCK"): FIRST,  # the LimitXXX= family, older than DefaultLimitXXX=
    ("Service", "LimitNOFILE"): FIRST,
    ("Install", "WantedBy"): FIRST,
    # system.conf.d
    ("Manager", "DefaultLimitMEMLOCK"): 183,  # NEWS 183: "system-wide DefaultLimitXXX= options"
    ("Manager", "DefaultLimitNOFILE"): 183,
}

# Values that came after their directive. For a directive listed here, every value used must be.
VALUES: dict[str, dict[str, int]] = {
    "ProtectSystem": {"yes": 214, "full": 214, "strict": 232},  # NEWS 232: new value "strict"
    "ProtectHome": {"yes": 214, "read-only": 214, "tmpfs": 242},  # NEWS 214: "inaccessible or read-only"
    "ProtectProc": {"noaccess": 247, "invisible": 247, "ptraceable": 247, "default": 247},
    "NotifyAccess": {"none": FIRST, "main": FIRST, "all": FIRST, "exec": 233},  # NEWS 233: "exec"
    # Named system call sets arrived in 231 (NEWS 231: "pre-defined, named system call filter
    # sets"), @module among them; @system-service is amended in NEWS 241, so it is no newer.
    "SystemCallFilter": {"@module": 231, "@system-service": 241},
    # The symbolic names came with the settings (systemd.resource-control(5)).
    "IPAddressAllow": {"any": 235, "localhost": 235, "link-local": 235, "multicast": 235},
    "IPAddressDeny": {"any": 235, "localhost": 235, "link-local": 235, "multicast": 235},
}


def shipped_units() -> list[Path]:
    """The unit and drop-ins the package installs: debian/tpuboot.service (dh_installsystemd)
    and the conf/systemd files debian/tpuboot.install names. tmpfiles.d is not unit syntax."""
    files = [(TOP / "debian/tpuboot.service").resolve()]
    for line in (TOP / "debian/tpuboot.install").read_text().splitlines():
        source = line.split()[0] if line.strip() and not line.startswith("#") else ""
        if source.startswith("conf/systemd/"):
            files.append((TOP / source).resolve())
    return files


def directives(path: Path) -> list[tuple[str, str, str]]:
    """(section, directive, value) for each assignment of a systemd unit or drop-in file."""
    found, section = [], ""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path}:{number}: continuation lines are not parsed here"
        if line.startswith("["):
            section = line.strip("[]")
            continue
        name, sep, value = line.partition("=")
        assert sep and section, f"{path}:{number}: not a directive: {line}"
        found.append((section, name.strip(), value.strip()))
    return found


def value_words(name: str, value: str) -> list[str]:
    """The words of ``value`` checked against VALUES: symbolic ones only (not paths or masks)."""
    words = value.split()
    if name.startswith("IPAddress"):
        return [w for w in words if not re.match(r"^[0-9a-fA-F:.]+(/\d+)?$", w)]
    if name == "SystemCallFilter":
        return [w.lstrip("~") for w in words if w.lstrip("~").startswith("@")]
    return words


def newer_than(version: int) -> list[str]:
    """Each use in a shipped file that is not listed or is newer than ``version``."""
    problems = []
    for path in shipped_units():
        rel = path.relative_to(TOP)
        for section, name, value in directives(path):
            introduced = DIRECTIVES.get((section, name))
            if introduced is None:
                problems.append(f"{rel}: [{section}] {name}= is not in the table: look it up in NEWS")
            elif introduced > version:
                problems.append(f"{rel}: [{section}] {name}= is systemd {introduced}")
            for word in value_words(name, value) if name in VALUES else []:
                since = VALUES[name].get(word)
                if since is None:
                    problems.append(f"{rel}: {name}={word} is not in the table: look it up in NEWS")
                elif since > version:
                    problems.append(f"{rel}: {name}={word} is systemd {since}")
    return problems


def test_every_unit_directive_exists_in_systemd_249():
    assert newer_than(OLDEST_SUPPORTED) == []


def test_the_check_sees_what_249_lacks():
    """ProtectProc= (247) and ProtectClock= (245) are what make a 244 fail: the table is used."""
    assert newer_than(244) == [
        "systemd/tpuboot.service: [Service] ProtectClock= is systemd 245",
        "systemd/tpuboot.service: [Service] ProtectProc= is systemd 247",
        "systemd/tpuboot.service: ProtectProc=invisible is systemd 247",
    ]


def test_every_shipped_unit_file_is_checked():
    """The unit and each drop-in in systemd/ and conf/systemd/, and nothing twice."""
    checked = shipped_units()
    in_tree = {p.resolve() for p in (TOP / "conf/systemd").rglob("*.conf")}
    in_tree |= {p.resolve() for p in (TOP / "systemd").glob("*") if p.suffix != ".tmpfiles"}
    assert sorted(checked) == sorted(in_tree)
    assert all(directives(path) for path in checked)


def test_directive_parser():
    sample = TOP / "systemd/tpuboot.service"
    parsed = directives(sample)
    assert ("Service", "ReadWritePaths", "/etc -/home/tpu-runtime") in parsed
    assert ("Service", "ReadWritePaths", "/sys/bus/pci /sys/devices /sys/module") in parsed
    assert ("Install", "WantedBy", "multi-user.target") in parsed
    assert value_words("IPAddressAllow", "localhost 169.254.169.254 10.0.0.0/8 ::1") == ["localhost"]
    assert value_words("SystemCallFilter", "~@mount @system-service") == ["@mount", "@system-service"]
