"""The etcd control plane: one client facade, the key layout, node membership under a lease,
block publication, load reports, the router's mirror of it all and the block index it feeds.

Knows keys (store/); nothing of the engine, the router, the worker or deployment.
"""
