"""The device side: which PCI functions are TPUs, binding them to vfio-pci, and watching udev."""
