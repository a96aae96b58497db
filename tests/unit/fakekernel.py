"""A temporary sysfs/dev tree plus a stand-in for the kernel's reaction to sysfs writes.

Unit tests only: the real kernel's behaviour is proved by the VM tests under tests/vm.
The tree mirrors real sysfs layout (driver and iommu_group links, drivers/<name>/unbind,
drivers_probe) so tpuboot's production code runs unchanged against it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tpuboot.paths import Root


class FakeKernel:
    def __init__(self, top: Path) -> None:
        self.top = top
        self.root = Root(top)
        self.writes: list[tuple[str, str]] = []
        self.modules: list[str] = []
        self.default_driver: dict[str, str | None] = {}
        self.refuse_probe: set[str] = set()
        self.create_nodes = True
        for d in ("sys/bus/pci/devices", "sys/bus/pci/drivers", "sys/kernel/iommu_groups", "dev/vfio"):
            (top / d).mkdir(parents=True, exist_ok=True)
        (top / "sys/bus/pci/drivers_probe").write_text("")

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
                os.chmod(node, 0o600)

    def driver(self, address: str) -> str | None:
        link = self.p(f"/sys/bus/pci/devices/{address}/driver")
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def group(self, address: str) -> str | None:
        link = self.p(f"/sys/bus/pci/devices/{address}/iommu_group")
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def override(self, address: str) -> str:
        return self.p(f"/sys/bus/pci/devices/{address}/driver_override").read_text().strip()

    # --- the kernel's side --------------------------------------------------------

    def write(self, path: Path, value: str) -> None:
        """What the kernel does when tpuboot writes ``value`` to the attribute at ``path``."""
        rel = "/" + str(path.relative_to(self.top))
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
        else:
            raise OSError(errno.EACCES, "unexpected write", rel)

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
        vfio_ready = self.p("/sys/bus/pci/drivers/vfio-pci").is_dir() and self.group(address)
        if target == "vfio-pci" and not vfio_ready:
            raise OSError(errno.EINVAL, "probe failed")
        self._link_driver(address, target)

    def load_module(self, name: str) -> None:
        self.modules.append(name)
        if name == "vfio-pci":
            self.add_driver("vfio-pci")
            self.load_module("vfio_iommu_type1")
        elif name == "vfio_iommu_type1":
            param = self.p("/sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts")
            if not param.exists():
                param.parent.mkdir(parents=True, exist_ok=True)
                param.write_text("N\n")
