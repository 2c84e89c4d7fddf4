"""Trace replay: Mooncake-format traces, a discrete-event simulator using the router's own
policies, live replay against a running router, and reports.

Knows the router's policies and index and the block pool; nothing of the worker or etcd.
"""
