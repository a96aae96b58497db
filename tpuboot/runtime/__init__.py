"""libtpu's runtime metrics: duty cycle, HBM and the fault gauges, read from the job's own libtpu.

libtpu serves ``tpu.monitoring.runtime.RuntimeMetricService`` over gRPC on each port of
``TPU_RUNTIME_METRICS_PORTS`` while a process holds it. :mod:`~tpuboot.runtime.wire` encodes the
few messages by hand (doc/runtime-metrics.md says why), :mod:`~tpuboot.runtime.client` makes the
calls, :mod:`~tpuboot.runtime.reading` turns one port's answers into readings,
:mod:`~tpuboot.runtime.collector` polls while a chip is held (the daemon's part),
:mod:`~tpuboot.runtime.statefile` keeps the faults for doctor and NPD and
:mod:`~tpuboot.runtime.top` shows it all in the terminal (`tpuboot top`).
"""
