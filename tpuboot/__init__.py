"""tpuboot: boot-time agent for Cloud TPU virtual machines."""

__version__ = "0.1.0"
