"""One node's prefix cache: block keys, the paged block pool and the KV arena.

Knows nothing of networks, etcd, Ray or HTTP.
"""
