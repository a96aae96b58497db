"""The kernel command-line parameters a TPU host needs: the one list of them.

The image checks judge the command line against it, the bind's IOMMU fix names its IOMMU
parameter, and the VM harness boots its guests with it. conf/grub.d/tpuboot.cfg, the shell
fragment grub-mkconfig sources, cannot import it: tests/unit/test_kernel_params.py sources that
file with sh for each architecture and checks that it appends exactly :func:`needed` words.
"""

from __future__ import annotations

#: uname -m's and dpkg's names for x86_64, the one architecture whose IOMMU needs a parameter.
X86 = ("x86_64", "amd64")

#: name -> (the value the TPU runtime needs, the architectures that need it; empty: every one), in
#: the order the GRUB drop-in appends them.
TPU_PARAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "idle": ("poll", ()),  # CPUs never enter low-power idle states (latency)
    "transparent_hugepage": ("always", ()),  # huge pages for the runtime's large buffers
    "intel_iommu": ("on,sm_on", X86),  # the IOMMU in the scalable mode vfio-pci needs
}


def word(name: str) -> str:
    """``name=value`` as the kernel command line carries it."""
    return f"{name}={TPU_PARAMS[name][0]}"


def needed(arch: str) -> list[str]:
    """The parameters an ``arch`` kernel (``uname -m`` or dpkg's name) needs, as words, in order."""
    return [word(name) for name, (_, arches) in TPU_PARAMS.items() if not arches or arch in arches]


#: The kernel parameter that turns the IOMMU on, in the scalable mode vfio-pci needs (x86_64).
IOMMU_PARAM = word("intel_iommu")
