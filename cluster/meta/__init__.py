"""The etcd control plane: one client facade, the key layout, node membership under a lease,
block publication, and the router's mirror of it all.

Knows keys (store/) and the router's block index; nothing of the engine, the worker or deployment.
"""
