"""Where a kernel module comes from on a kernel: built in, loaded, loadable, or nowhere.

Ubuntu's kernels build vfio-pci in (``CONFIG_VFIO_PCI=y``); Debian's ship it as a module. A
built-in driver never appears in ``/proc/modules`` (so ``lsmod`` shows nothing), ``modprobe``
succeeds doing nothing and modprobe.d options do not reach it; its ``/sys/module/<name>`` exists
only because it has parameters (Documentation/ABI/stable/sysfs-module: "not by design and may be
removed"), with ``parameters/`` but no ``initstate``, ``refcnt`` or ``holders``. So "is it
loaded?" is the wrong question on Ubuntu; "is it in this kernel, and how?" is the right one.

The evidence, strongest first, as kmod weighs it:

- ``/lib/modules/<release>/modules.builtin`` (and ``modules.builtin.modinfo``, kernel 5.2+),
  written by the kernel build: built in;
- ``/proc/modules`` or ``/sys/module/<name>/initstate`` (loadable modules only): loaded;
- ``/sys/module/<name>`` without ``initstate``: built in (the list above may be missing);
- ``modules.dep`` (depmod's list of loadable modules): loadable, not loaded.

Everything is read under a :class:`~tpuboot.paths.Root`, so an image tree (no /proc, no /sys)
is judged from its ``/lib/modules`` alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from tpuboot.atomicfile import read_file
from tpuboot.paths import Root

MODULES_DIR = "/lib/modules"
#: modules.dep of a distribution kernel is ~1 MiB; modules.builtin.modinfo a few hundred KiB.
MAX_LIST = 32 << 20

Origin = Literal["built-in", "loaded", "loadable", "absent", "unknown"]


@dataclass(frozen=True)
class ModuleState:
    """How ``name`` is present in kernel ``release``, and the file that says so."""

    name: str
    release: str | None
    origin: Origin
    evidence: str

    @property
    def kernel(self) -> str:
        return f"kernel {self.release}" if self.release else "this kernel"


def canonical(name: str) -> str:
    """A module's name as the kernel spells it: ``vfio-pci``, ``vfio-pci.ko.zst`` -> ``vfio_pci``."""
    base = os.path.basename(name)
    base = re.sub(r"\.ko(\.(gz|xz|zst|bz2))?$", "", base)
    return base.replace("-", "_")


def _text(root: Root, path: str) -> str | None:
    data = read_file(root, path, limit=MAX_LIST)
    return None if data is None else data.decode("utf-8", "replace")


def running_release(root: Root) -> str | None:
    """The running kernel's release (``uname -r``), None on a tree that is not a running system."""
    text = _text(root, "/proc/sys/kernel/osrelease")
    if text is not None and text.strip():
        return text.strip()
    return os.uname().release if root.is_host else None


def installed_releases(root: Root) -> list[str]:
    """Kernels with a module directory that depmod or the kernel build filled, sorted by name."""
    top = root.path(MODULES_DIR)
    if not top.is_dir():
        return []
    return sorted(
        entry.name
        for entry in top.iterdir()
        if any(
            root.path(f"{MODULES_DIR}/{entry.name}/{f}").is_file() for f in ("modules.dep", "modules.builtin")
        )
    )


def in_kernel(root: Root, release: str, name: str) -> ModuleState:
    """What ``release``'s module lists say of ``name``: built in, loadable, absent or unknown."""
    module = canonical(name)
    where = f"{MODULES_DIR}/{release}"
    builtin = _text(root, f"{where}/modules.builtin")
    if builtin is not None and any(canonical(line.strip()) == module for line in builtin.splitlines()):
        return ModuleState(module, release, "built-in", f"{where}/modules.builtin")
    modinfo = _text(root, f"{where}/modules.builtin.modinfo")
    if modinfo is not None and any(entry.startswith(f"{module}.") for entry in modinfo.split("\0")):
        return ModuleState(module, release, "built-in", f"{where}/modules.builtin.modinfo")
    dep = _text(root, f"{where}/modules.dep")
    if dep is not None and any(canonical(line.partition(":")[0]) == module for line in dep.splitlines()):
        return ModuleState(module, release, "loadable", f"{where}/modules.dep")
    if builtin is None and dep is None:
        return ModuleState(module, release, "unknown", f"no {where}/modules.dep or modules.builtin")
    return ModuleState(module, release, "absent", f"neither {where}/modules.builtin nor modules.dep lists it")


def module_state(root: Root, name: str) -> ModuleState:
    """How ``name`` is present in the running kernel under ``root`` (see the module docstring)."""
    module = canonical(name)
    release = running_release(root)
    if release is not None:
        listed = in_kernel(root, release, module)
        if listed.origin == "built-in":
            return listed
    else:
        listed = ModuleState(module, None, "unknown", "no /proc/sys/kernel/osrelease")
    proc = _text(root, "/proc/modules")
    if proc is not None and any(line.split(" ", 1)[0] == module for line in proc.splitlines()):
        return ModuleState(module, release, "loaded", "/proc/modules")
    sysfs = root.path(f"/sys/module/{module}")
    if (sysfs / "initstate").exists():
        return ModuleState(module, release, "loaded", f"/sys/module/{module}/initstate")
    if sysfs.is_dir():
        if listed.origin == "loadable":  # initstate comes a moment after the directory
            return ModuleState(module, release, "loaded", f"/sys/module/{module} (being loaded)")
        # A loadable module always has initstate: this one is built in (and has parameters).
        return ModuleState(module, release, "built-in", f"/sys/module/{module} without initstate")
    return listed


#: What to do about a kernel without vfio-pci, in either form.
NO_VFIO_PCI_FIX = (
    "boot a kernel built with CONFIG_VFIO_PCI (=y as Ubuntu's generic and -gcp kernels, =m as "
    "Debian's linux-image with its modules installed), then reboot"
)
