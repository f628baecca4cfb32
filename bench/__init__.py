"""Benchmarks for statestore: `make bench` (see bench/README.md)."""
