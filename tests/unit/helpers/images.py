"""Image trees for the image-check, doctor, leftover and holder tests: good settings, a file
writer, systemctl stand-ins, and the documented procedure's files (bench/baseline/) as leftovers.
"""

from __future__ import annotations

from pathlib import Path

from tpuboot.checks.parsers.systemd import Systemd
from tpuboot.paths import Root

GOOD_CMDLINE = (
    "BOOT_IMAGE=/vmlinuz root=UUID=1 ro idle=poll transparent_hugepage=always intel_iommu=on,sm_on\n"
)


PAM_GOOD = """\
*     -    memlock  unlimited
root  -    memlock  unlimited
*     -    nofile   100000
root  -    nofile   100000
"""


MANAGER_GOOD = "[Manager]\nDefaultLimitMEMLOCK=infinity\nDefaultLimitNOFILE=100000\n"


def write(tree: Path, path: str, text: str) -> Path:
    real = tree / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.write_text(text)
    return real


class NoSystemctl(Systemd):
    """Tests read files only (a temporary tree is never live); a test that wants systemctl's
    answer passes an :class:`Answering`."""

    def show(self, unit: str | None, properties: list[str]) -> dict[str, str] | None:
        raise AssertionError("a test ran systemctl")


class Answering(Systemd):
    """A running systemd whose ``systemctl show`` answers ``answers[unit]`` (None: cannot answer)."""

    def __init__(self, answers: dict[str | None, dict[str, str]] | None) -> None:
        self.answers = answers
        self.asked: list[str | None] = []

    def live(self, root: Root) -> bool:
        return True

    def show(self, unit: str | None, properties: list[str]) -> dict[str, str] | None:
        self.asked.append(unit)
        return None if self.answers is None else self.answers.get(unit, {"LoadState": "not-found"})


REPO = Path(__file__).resolve().parents[3]


BASELINE = REPO / "bench/baseline"


VFIO_RULES = (BASELINE / "99-tpu-vfiopci.rules").read_text()


BIND_SCRIPT = (BASELINE / "bind_to_vfio_pci.sh").read_text()
