"""The node core our worker and the vLLM connector's pool share.

    blocks.py     one node's blocks built from sizes: device pool over its arena, host and SSD tiers
    exchange.py   fetch from a peer, publish where each block is now, collect finished SSD writes
    core.py       the node's presence: transfer server, etcd lease and publisher, SSD collection
    faults.py     the one fault injector of the transfer server (tests and chaos runs only)

Imports only store, transfer and meta: the connector loads it inside vLLM's process.
"""
