"""One worker node: the worker service (engine + pool + transfer server + etcd presence), its
internal HTTP API (the router contract's server side), and its tier chain.

Knows the engine and the etcd control plane; nothing of how the process was started.
"""
