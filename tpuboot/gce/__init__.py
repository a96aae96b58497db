"""The GCE metadata server: the one client every part of tpuboot asks, and the guest attributes.

Imports nothing, so ``tpuboot.gce.keys`` stays cheap for the CLI's argument parser. A module per
job: ``keys`` (where things are in the metadata tree), ``settings`` (the server's address and the
client's limits, plain values the caller takes from its configuration), ``replies`` (answers and
refusals), ``framing`` (what makes an HTTP answer the metadata server's), ``transport`` (sockets a
deadline and another thread can end; one try), ``failures`` (each kind of failure logged once),
``client`` (retries within a deadline), ``watch`` (the long-poll of one key), ``lookup`` (`tpuboot
metadata get`), ``guestattrs`` (this host's state in the guest attributes).
"""
