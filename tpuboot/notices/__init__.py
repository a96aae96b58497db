"""Maintenance and preemption notices: the metadata server's warnings, the hooks they run, and the
file a job reads (doc/notices.md)."""
