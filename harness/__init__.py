"""What tpuboot's tests and benchmarks run it against, shared by ``tests/`` and ``bench/``.

* :mod:`harness.mds_emulator` -- a GCE metadata server on 127.0.0.1 or in a guest (faults,
  long-polls, guest attributes); also a script the VM guests run.
* :mod:`harness.matrix` -- the library-matrix rows: each system's Python minor version and its
  requirement file (scripts/matrix/).
* :mod:`harness.polling` -- the one polling helper (wait until a condition holds, within a bound)
  of the unit tests, the VM tests and the harness.
* :mod:`harness.pythons` -- another CPython found by minor version (pyenv's, then PATH), copied so
  that any user can run it, from any place.
* :mod:`harness.vm` -- the real-kernel harness: Debian guests in QEMU, their kernel, images and
  command channel, and tpuboot's .deb installed in them.
"""
