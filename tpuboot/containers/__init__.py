"""The supervised containers: vBar and the telemetry collector, their runtimes and restart policy."""
