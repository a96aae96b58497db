"""Real-kernel scenarios: tpuboot in Debian 12 and 13 guests under QEMU.

The harness these tests drive (QEMU machine, guest images, metadata emulator) is the top-level
``harness`` package, shared with ``bench/``; ``conftest.py`` here holds the pytest fixtures.
"""
