"""Real-kernel harness: Debian 12 and Debian 13 guests in QEMU, each booting its own kernel.

tpuboot binds PCI devices to vfio-pci through sysfs and runs as a systemd
service; only a real kernel with a real (emulated) IOMMU shows whether that
works. This package boots such a guest fast enough for tests (TCG: about 10 s
to a running systemd; about 1.5 min to build everything from an empty cache).

Modules, one responsibility each:

* :mod:`.hostenv`     -- cache folder, host prerequisites, apt mirror (read from /etc/apt), runner.
* :mod:`.kernelimage` -- pull the uncompressed ELF ``vmlinux`` out of a bzImage (PVH boot).
* :mod:`.artifacts`   -- cached kernel, busybox initramfs, Debian guest tree per :class:`Platform`
  (``BOOKWORM``: Debian 12, kernel 6.1, the default; ``TRIXIE``: Debian 13, kernel 6.12, systemd
  257, Python 3.13, fetched through a private apt state since the host's apt knows bookworm only);
  per-session images.
* :mod:`.accel`       -- choose KVM or TCG by a real probe boot (once per process).
* :mod:`.qmp`         -- a small QMP client (commands and events).
* :mod:`.guestcmd`    -- host side of the guest command server on the second serial port.
* :mod:`.machine`     -- :class:`~.machine.VM`, the QEMU machine a test drives.
* :mod:`.tpuboot_guest` -- tpuboot's .deb and the metadata emulator in a guest tree (install
  hooks, stand-in devices, the vBar guest), and steering them in the running guest.
* :mod:`.pyguest`     -- a library-matrix row's CPython with its libraries in a guest tree, the
  unit's ExecStart pointed at it (jammy's 3.10: tests/vm/test_tpuboot_ubuntu_userland.py).
* :mod:`.demo`        -- ``scripts/demo``, on its own guest (``DEMO_BOOKWORM``: Debian 12 with dockerd
  for vBar and podman for a container through the CDI spec).
* ``guest/``          -- files for the guest: ``guestcmd.py`` + its unit, ``vfio_read.py`` (both
  installed at ``/usr/local/libexec/tpuboot-test/``), ``initramfs-init``.

tests/vm/conftest.py makes pytest fixtures of it (``vm`` marker, failure reports, per-test time
limit); bench/ drives it directly.

Main API:

* ``ensure_artifacts(platform=BOOKWORM) -> Artifacts`` (``.kernel``, ``.initrd``, ``.tree``,
  ``.boot_kernel``, ``.platform``).
* ``build_image(artifacts, dest, install=None) -> Path``: ``install(tree)`` gets a writable
  view of the guest tree (overlayfs; the cache is never touched). Helpers for hooks:
  ``in_tree(tree, "/etc/x")``, ``chroot_run(tree, argv)``, ``install_debs(tree, [deb])``.
* ``VM(image, kernel, initrd, *, cmdline_extra="", iommu=True, devices=(), hotplug_ports=0,
  memory=1024, smp=2, accel=None, reboot=False, quiet=True, name="vm", workdir=None)``, a
  context manager: ``start()``, ``wait_booted(timeout) -> BootStatus``, ``run(cmd, *, user,
  timeout, stdin, env, cwd, check) -> Result``, ``write_file``, ``read_file``, ``wait_until``,
  ``pci_devices(vendor, device) -> [PciDevice]``, ``qmp(cmd, **args)``, ``device_add(driver,
  id, bus)``, ``device_del(id)``, ``journal(unit)``, ``console_log()``, ``reboot()``,
  ``shutdown()``, ``kill()``; ``hotplug_ports`` lists the root-port ids (``hp0``...).
* ``ensure_row_python(row) -> Path`` (cached) and ``with_row_python(install, row, prefix)``: an
  install hook that adds a library-matrix row's CPython and libraries and runs the unit on them.
* Fixtures: ``vm_bench(platform) -> PlatformBench`` (``.artifacts``, ``.image(install, key=)``),
  ``vm_artifacts``, ``vm_image_factory(install=None, *, key="base")`` (both Debian 12),
  ``vm_image``, ``vm_factory(image=None, *, boot=True, **VM kwargs)``, ``tpuboot_images(platform)``.
  A module runs on both guests by parametrizing its module-scoped VM fixture with
  ``params=PLATFORMS`` (test ids ``[debian12]``, ``[debian13]``; see test_tpuboot_service.py).

Typical use in a test module under tests/vm::

    from harness.vm.artifacts import in_tree
    from harness.vm.machine import VM

    @pytest.fixture(scope="session")
    def tpuboot_image(vm_image_factory):
        def install(tree):
            shutil.copytree(REPO / "tpuboot", in_tree(tree, "/usr/lib/python3/dist-packages/tpuboot"))
        return vm_image_factory(install, key="tpuboot-src")

    def test_binds(vm_factory, tpuboot_image):
        vm = vm_factory(tpuboot_image, devices=["edu"] * 4, hotplug_ports=1)
        vm.run(["systemctl", "is-active", "tpuboot"], check=True)

Environment: ``TPUBOOT_VM_CACHE`` (cache folder), ``TPUBOOT_VM_ACCEL=kvm|tcg`` (skip the
probe), ``TPUBOOT_SKIP_VM=1`` (skip instead of fail where VMs cannot run),
``TPUBOOT_VM_TEST_TIMEOUT`` (seconds per test call, default 600), ``TPUBOOT_VM_KEEP=1``
(keep each VM's work folder with console.log and qemu.log).
"""
