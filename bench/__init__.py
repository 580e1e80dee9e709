"""Benchmarks, the demo, and the process harness they share with the end-to-end tests."""
