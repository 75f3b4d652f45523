"""Benchmarks: each module is a program (`python -m bench.NAME`); none is imported by the product."""
