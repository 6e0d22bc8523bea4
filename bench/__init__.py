"""Benchmarks: each module runs with `.venv/bin/python -m bench.NAME` and appends its results to BENCHMARKS.md."""
