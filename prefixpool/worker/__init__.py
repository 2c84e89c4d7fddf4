"""One worker process: the engine, the node's blocks and transfer server, etcd presence, and the
internal HTTP API the router calls (the server side of contract/worker_api).

Knows the engine, the node core and meta/; nothing of how the process was started.
"""
