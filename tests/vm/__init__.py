"""Real-kernel test bench: Debian's own kernel and a Debian 12 guest in QEMU.

tpuboot binds PCI devices to vfio-pci through sysfs and runs as a systemd
service; only a real kernel with a real IOMMU shows whether that works. This
package boots such a guest quickly enough for tests.

Modules, one responsibility each:

* :mod:`.hostenv`     -- cache location, host prerequisites, apt mirror, command runner.
* :mod:`.kernelimage` -- pull the uncompressed ELF ``vmlinux`` out of a bzImage (PVH boot).
* :mod:`.artifacts`   -- cached kernel, busybox initramfs, Debian guest tree; per-session images.
* :mod:`.accel`       -- choose KVM or TCG by a real probe boot (once per process).
* :mod:`.qmp`         -- a small QMP client (commands and events).
* :mod:`.agent`       -- host side of the guest command agent on the second serial port.
* :mod:`.machine`     -- :class:`VM`, the QEMU machine a test drives.
* ``guest/``          -- files installed into the guest (agent, VFIO proof script, initramfs init).

Typical use (the pytest fixtures in ``conftest.py`` do the first two steps)::

    arts = ensure_artifacts()                    # cached under .cache/vm/
    image = build_image(arts, install=my_hook, dest=tmp / "root.ext4")
    with VM(image, arts.boot_kernel, arts.initrd, devices=["edu"], hotplug_ports=1) as vm:
        vm.wait_booted()
        assert vm.run(["uname", "-r"], check=True).stdout.strip() == arts.kernel.version

Test modules in this folder import with relative imports (``from .machine import VM``).
"""
