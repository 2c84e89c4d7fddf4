"""One worker node: the worker service (engine + the node's blocks + transfer server + etcd
presence) and its internal HTTP API (the router contract's server side).

Knows the engine and the etcd control plane; nothing of how the process was started.
"""
