"""Helpers for tests and benchmarks: chaos clients and faults, test hosts in network namespaces,
a null worker, a tiny Llama checkpoint. Nothing in the package imports this wing.
"""
