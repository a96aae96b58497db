"""Checks with fixes: image settings (`tpuboot image-check`) and workload readiness (`tpuboot doctor`)."""
