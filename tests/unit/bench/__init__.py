"""The bench's tests that need no guest; those that boot one (tests/vm/test_soak.py,
tests/vm/test_bench_smoke.py) live in tests/vm for its fixtures."""
