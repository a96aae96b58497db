"""The stand-ins unit tests run tpuboot against: the kernel's sysfs (kernel), dockerd, /proc."""
