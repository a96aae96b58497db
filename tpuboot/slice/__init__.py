"""The slice, not just the host: ``tpuboot slice`` and ``tpuboot wait-slice``.

A multi-host job starts on every worker of a slice at once and hangs at its first barrier when one
worker's identity is wrong or a firewall drops one port. :mod:`~tpuboot.slice.workers` reads the
worker list, :mod:`~tpuboot.slice.identity` judges who this worker is, :mod:`~tpuboot.slice.ports`
says which ports each role needs, :mod:`~tpuboot.slice.sweep` connects to every peer at once,
:mod:`~tpuboot.slice.verdict` puts the findings together and :mod:`~tpuboot.slice.wait` repeats it
until all hold; :mod:`~tpuboot.env.published` is what each worker publishes for the comparison no
single worker can make. doc/slice.md explains each finding and its fix.
"""
