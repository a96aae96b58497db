"""A temporary sysfs/dev tree plus a stand-in for the kernel's reaction to sysfs writes.

Unit tests only: the real kernel's behaviour is proved by the VM tests under tests/vm.
The tree mirrors real sysfs layout (driver and iommu_group links, drivers/<name>/unbind,
drivers_probe) so tpuboot's production code runs unchanged against it.

``vfio`` shapes the kernel the way each distribution builds vfio-pci:

- ``"module"`` (Debian): vfio-pci is in modules.dep and appears only when loaded, as a loadable
  module does: a line in /proc/modules, ``/sys/module/vfio_pci`` with ``initstate``, ``refcnt``,
  ``holders/``, ``sections/``, and the driver under /sys/bus/pci/drivers.
- ``"builtin"`` (Ubuntu's generic and linux-gcp kernels, ``CONFIG_VFIO_PCI=y``): the driver is
  registered from boot; no /proc/modules line; ``/sys/module/vfio_pci`` exists only for its
  parameters (no ``initstate``, ``refcnt``, ``holders``, ``sections``, ``coresize``), as
  Documentation/ABI/stable/sysfs-module says of built-ins; ``vfio_iommu_type1``'s
  ``allow_unsafe_interrupts`` is there and writable; modules.builtin and modules.builtin.modinfo
  list the vfio modules; ``modprobe vfio-pci`` succeeds and changes nothing.
- ``"none"``: a kernel without vfio-pci in either form; ``modprobe vfio-pci`` fails as kmod does.
"""

from __future__ import annotations

import builtins
import errno
import os
import pathlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tpuboot.errors import TpubootError
from tpuboot.paths import Root

VfioShape = Literal["module", "builtin", "none"]
RELEASES = {"module": "6.1.0-28-cloud-amd64", "builtin": "6.8.0-1015-gcp", "none": "6.1.0-28-cloud-amd64"}
#: The vfio stack as files under /lib/modules/<release>/ (what depmod and the kernel build list).
VFIO_FILES = {
    "vfio": "kernel/drivers/vfio/vfio.ko",
    "vfio_iommu_type1": "kernel/drivers/vfio/vfio_iommu_type1.ko",
    "vfio_pci_core": "kernel/drivers/vfio/pci/vfio-pci-core.ko",
    "vfio_pci": "kernel/drivers/vfio/pci/vfio-pci.ko",
}
#: Module parameters (name -> value) as their sysfs files hold them, loaded or built in.
VFIO_PARAMETERS = {
    "vfio": {"enable_unsafe_noiommu_mode": "N"},
    "vfio_iommu_type1": {
        "allow_unsafe_interrupts": "N",
        "disable_hugepages": "N",
        "dma_entry_limit": "65535",
    },
    "vfio_pci_core": {"disable_idle_d3": "N", "disable_vga": "N", "nointxmask": "N"},
    "vfio_pci": {"ids": "", "disable_denylist": "N", "enable_sriov": "N"},
}
OTHER_MODULES = ("nvme", "virtio_net", "tls")  # loaded on every such VM; never vfio
# The kernel's own accesses bypass Faults (which wraps these for tpuboot's code only).
_readlink, _chmod, _read_text, _is_dir = os.readlink, os.chmod, pathlib.Path.read_text, pathlib.Path.is_dir


class FakeKernel:
    def __init__(self, top: Path, vfio: VfioShape = "module") -> None:
        self.top = top
        self.root = Root(top)
        self.vfio = vfio
        self.release = RELEASES[vfio]
        self.writes: list[tuple[str, str]] = []
        self.modules: list[str] = []  # every module load asked for, in order (modprobe's argument)
        self.default_driver: dict[str, str | None] = {}
        self.refuse_probe: set[str] = set()
        self.specs: dict[str, tuple[int, int, tuple[int, int], str | None, str | None]] = {}
        self.removed: set[str] = set()  # functions written to `remove`, back at the next rescan
        self.on_reset: Callable[[str], None] = lambda address: None  # a function reset's effect
        self.create_nodes = True
        self.faults = Faults(top)
        self._loading = threading.Lock()  # binds run in a thread pool: one modprobe at a time
        for d in ("sys/bus/pci/devices", "sys/bus/pci/drivers", "sys/kernel/iommu_groups", "dev/vfio"):
            (top / d).mkdir(parents=True, exist_ok=True)
        (top / "sys/bus/pci/drivers_probe").write_text("")
        self._write_kernel_lists()
        if vfio == "builtin":
            for module in VFIO_FILES:
                self._module_dir(module, loadable=False)
            self._register_vfio_pci()

    # --- the kernel's module lists and /sys/module ------------------------------------

    def _write_kernel_lists(self) -> None:
        """osrelease, /proc/modules and the lists of /lib/modules/<release>, as the shape has them."""
        self._text("/proc/sys/kernel/osrelease", self.release + "\n")
        self._text("/proc/modules", "")
        for module in OTHER_MODULES:
            self._proc_module(module)
        where = f"/lib/modules/{self.release}"
        others = [f"kernel/drivers/net/{m}.ko" for m in OTHER_MODULES]
        builtin = ["kernel/drivers/pci/pcie/pcieport.ko", "kernel/drivers/virtio/virtio_pci.ko"]
        if self.vfio == "builtin":
            builtin += VFIO_FILES.values()
            modinfo = (
                "".join(f"{m}.license=GPL v2\0{m}.description=vfio stack\0" for m in VFIO_FILES)
                + "virtio_pci.license=GPL\0"
            )
            self._text(f"{where}/modules.builtin.modinfo", modinfo)
        elif self.vfio == "module":
            others += VFIO_FILES.values()
        self._text(f"{where}/modules.builtin", "".join(f"{line}\n" for line in builtin))
        self._text(f"{where}/modules.dep", "".join(f"{line}:\n" for line in others))

    def _text(self, absolute: str, text: str) -> None:
        path = self.p(absolute)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _proc_module(self, module: str) -> None:
        with open(self.p("/proc/modules"), "a") as lines:
            lines.write(f"{module} 16384 0 - Live 0x0000000000000000\n")

    def _module_dir(self, module: str, loadable: bool) -> None:
        """/sys/module/<module>: parameters for both; the attributes only a loadable module has."""
        d = self.p(f"/sys/module/{module}")
        for name, value in VFIO_PARAMETERS[module].items():
            self._text(f"/sys/module/{module}/parameters/{name}", value + "\n")
        (d / "uevent").write_text("")
        if loadable:
            (d / "initstate").write_text("live\n")
            (d / "refcnt").write_text("0\n")
            (d / "coresize").write_text("16384\n")
            (d / "holders").mkdir()
            (d / "sections").mkdir()

    def _register_vfio_pci(self) -> None:
        """The driver registers; its ``module`` link and the module's ``drivers/pci:vfio-pci``."""
        self.add_driver("vfio-pci")
        os.symlink("../../../../module/vfio_pci", self.p("/sys/bus/pci/drivers/vfio-pci/module"))
        drivers = self.p("/sys/module/vfio_pci/drivers")
        drivers.mkdir(exist_ok=True)
        os.symlink("../../../bus/pci/drivers/vfio-pci", drivers / "pci:vfio-pci")

    def loaded(self) -> list[str]:
        """What lsmod would list."""
        text = self.p("/proc/modules").read_text()
        return [line.split(" ", 1)[0] for line in text.splitlines()]

    def p(self, absolute: str) -> Path:
        return self.root.path(absolute)

    # --- building the tree ----------------------------------------------------------

    def add_driver(self, name: str) -> None:
        d = self.p(f"/sys/bus/pci/drivers/{name}")
        d.mkdir(parents=True, exist_ok=True)
        for attr in ("bind", "unbind", "new_id"):
            (d / attr).touch()

    def add_device(
        self,
        address: str,
        vendor: int,
        device: int,
        subsystem: tuple[int, int] = (0, 0),
        driver: str | None = None,
        group: str | None = None,
    ) -> None:
        self.specs[address] = (vendor, device, subsystem, driver, group)
        d = self.p(f"/sys/bus/pci/devices/{address}")
        d.mkdir(parents=True)
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "device").write_text(f"0x{device:04x}\n")
        (d / "subsystem_vendor").write_text(f"0x{subsystem[0]:04x}\n")
        (d / "subsystem_device").write_text(f"0x{subsystem[1]:04x}\n")
        (d / "uevent").write_text(
            f"PCI_ID={vendor:04X}:{device:04X}\nPCI_SUBSYS_ID={subsystem[0]:04X}:{subsystem[1]:04X}\n"
            f"PCI_SLOT_NAME={address}\n"
        )
        (d / "driver_override").write_text("(null)\n")
        # Config space starts with the vendor and device ids (little-endian), as the kernel shows it.
        ids = vendor.to_bytes(2, "little") + device.to_bytes(2, "little")
        (d / "config").write_bytes(ids + bytes(60))
        (d / "remove").touch()  # every function has it; `reset` only one the kernel can reset
        if group is not None:
            g = self.p(f"/sys/kernel/iommu_groups/{group}/devices")
            g.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../../../bus/pci/devices/{address}", g / address)
            os.symlink(f"../../../kernel/iommu_groups/{group}", d / "iommu_group")
        self.default_driver[address] = driver
        if driver:
            self._link_driver(address, driver)

    def remove_device(self, address: str) -> None:
        import shutil

        shutil.rmtree(self.p(f"/sys/bus/pci/devices/{address}"))

    def _link_driver(self, address: str, driver: str) -> None:
        self.add_driver(driver)
        os.symlink(f"../../drivers/{driver}", self.p(f"/sys/bus/pci/devices/{address}/driver"))
        if driver == "vfio-pci":
            group = self.group(address)
            if group and self.create_nodes:
                node = self.p(f"/dev/vfio/{group}")
                node.touch()
                _chmod(node, 0o600)

    def driver(self, address: str) -> str | None:
        link = self.p(f"/sys/bus/pci/devices/{address}/driver")
        return os.path.basename(_readlink(link)) if link.is_symlink() else None

    def group(self, address: str) -> str | None:
        link = self.p(f"/sys/bus/pci/devices/{address}/iommu_group")
        return os.path.basename(_readlink(link)) if link.is_symlink() else None

    def override(self, address: str) -> str:
        return _read_text(self.p(f"/sys/bus/pci/devices/{address}/driver_override")).strip()

    # --- the kernel's side --------------------------------------------------------

    def write(self, path: Path, value: str) -> None:
        """What the kernel does when tpuboot writes ``value`` to the attribute at ``path``."""
        rel = "/" + str(path.relative_to(self.top))
        self.faults.check("write", path)
        self.writes.append((rel, value))
        value = value.strip()
        parts = rel.split("/")
        if rel == "/sys/bus/pci/drivers_probe":
            self._probe(value)
        elif parts[-1] == "driver_override":
            path.write_text((value or "(null)") + "\n")
        elif parts[-1] == "unbind":
            self._unbind(value)
        elif rel.startswith("/sys/module/"):
            path.write_text("Y\n" if value in ("1", "Y") else "N\n")
        elif parts[-1] == "reset" and value == "1":
            self.on_reset(parts[-2])
        elif parts[-1] == "remove" and value == "1":
            self._remove(parts[-2])
        elif rel == "/sys/bus/pci/rescan" and value == "1":
            for address in sorted(self.removed):
                vendor, device, subsystem, driver, group = self.specs[address]
                self.add_device(address, vendor, device, subsystem, driver=driver, group=group)
            self.removed.clear()
        else:
            raise OSError(errno.EACCES, "unexpected write", rel)

    def _remove(self, address: str) -> None:
        """What `remove` does: the driver let go, the function gone from sysfs and its group."""
        if self.driver(address) is not None:
            self._unbind(address)
        group = self.group(address)
        if group is not None:
            self.p(f"/sys/kernel/iommu_groups/{group}/devices/{address}").unlink()
        self.remove_device(address)
        self.removed.add(address)

    def _unbind(self, address: str) -> None:
        link = self.p(f"/sys/bus/pci/devices/{address}/driver")
        if not link.is_symlink():
            raise OSError(errno.ENODEV, "not bound")
        was = self.driver(address)
        link.unlink()
        group = self.group(address)
        if was == "vfio-pci" and group:
            self.p(f"/dev/vfio/{group}").unlink(missing_ok=True)

    def _probe(self, address: str) -> None:
        if self.driver(address) is not None:
            return
        override = self.override(address)
        target = self.default_driver.get(address) if override == "(null)" else override
        if target is None or address in self.refuse_probe:
            return
        vfio_ready = _is_dir(self.p("/sys/bus/pci/drivers/vfio-pci")) and self.group(address)
        if target == "vfio-pci" and not vfio_ready:
            raise OSError(errno.EINVAL, "probe failed")
        self._link_driver(address, target)

    def load_module(self, name: str) -> None:
        """``modprobe name``: loads it and what it needs; nothing for a built-in; fails if absent."""
        self.modules.append(name)
        module = name.replace("-", "_")
        if module not in VFIO_FILES or self.vfio == "builtin":
            return  # built in (or not a module these tests model): modprobe succeeds doing nothing
        if self.vfio == "none":
            raise TpubootError(
                f"modprobe {name} failed: modprobe: FATAL: Module {name} not found in directory "
                f"/lib/modules/{self.release}"
            )
        # kmod: vfio-pci's dependencies, and vfio's softdep on vfio_iommu_type1.
        wanted = [module]
        if module == "vfio_pci":
            wanted = ["vfio", "vfio_iommu_type1", "vfio_pci_core", "vfio_pci"]
        with self._loading:
            for each in wanted:
                if not self.p(f"/sys/module/{each}").is_dir():
                    self._module_dir(each, loadable=True)
                    self._proc_module(each)
            if module == "vfio_pci" and not self.p("/sys/bus/pci/drivers/vfio-pci").is_dir():
                self._register_vfio_pci()

    def unload_module(self, name: str) -> None:
        """``rmmod name`` (devices left as they are): a built-in cannot be removed, as kmod says."""
        import shutil

        module = name.replace("-", "_")
        if self.vfio == "builtin" and module in VFIO_FILES:
            raise TpubootError(f"rmmod: ERROR: Module {module} is builtin.")
        with self._loading:
            shutil.rmtree(self.p(f"/sys/module/{module}"))
            lines = self.p("/proc/modules").read_text().splitlines(keepends=True)
            self.p("/proc/modules").write_text("".join(x for x in lines if x.split(" ", 1)[0] != module))
            if module == "vfio_pci":
                shutil.rmtree(self.p("/sys/bus/pci/drivers/vfio-pci"))


# --- faults: an errno at one step -------------------------------------------------------------

Op = Literal["open", "readlink", "stat", "listdir", "chmod", "write"]


class Faults:
    """Makes one kind of access to paths ending in a suffix fail with an errno, as the kernel would.

    ``write`` faults act in FakeKernel.write; the others need :meth:`install`, which wraps the os
    and pathlib calls tpuboot makes (open, readlink, stat and is_dir/exists, listdir, chmod) for
    paths under this tree only.
    """

    def __init__(self, top: Path) -> None:
        self.top = str(top)
        self.rules: list[list[Any]] = []  # [op, suffix, errno, times left or None]
        self.hits: list[tuple[str, str]] = []

    def add(self, op: Op, suffix: str, code: int, times: int | None = None) -> None:
        self.rules.append([op, suffix, code, times])

    def clear(self) -> None:
        self.rules.clear()

    def check(self, op: str, path: object) -> None:
        try:
            text = os.fspath(path)  # type: ignore[arg-type]
        except TypeError:
            return  # a file descriptor
        if isinstance(text, bytes) or not text.startswith(self.top):
            return
        for rule in self.rules:
            if rule[0] == op and text.endswith(rule[1]) and rule[3] != 0:
                if rule[3] is not None:
                    rule[3] -= 1
                self.hits.append((op, text[len(self.top) :]))
                raise OSError(rule[2], os.strerror(rule[2]), text)

    def install(self, monkeypatch: Any) -> None:
        """Route the calls through :meth:`check` for the rest of the test."""

        def wrap(owner: object, name: str, op: str, bind_self: bool = False) -> None:
            real = getattr(owner, name)

            if bind_self:

                def method(self_: Any, *args: Any, **kwargs: Any) -> Any:
                    self.check(op, self_)
                    return real(self_, *args, **kwargs)

                monkeypatch.setattr(owner, name, method)
            else:

                def function(path: Any, *args: Any, **kwargs: Any) -> Any:
                    self.check(op, path)
                    return real(path, *args, **kwargs)

                monkeypatch.setattr(owner, name, function)

        wrap(builtins, "open", "open")
        wrap(os, "readlink", "readlink")
        wrap(os, "stat", "stat")
        wrap(os, "listdir", "listdir")
        wrap(os, "chmod", "chmod")
        for name, op in (("read_text", "open"), ("is_dir", "stat"), ("exists", "stat")):
            wrap(pathlib.Path, name, op, bind_self=True)
