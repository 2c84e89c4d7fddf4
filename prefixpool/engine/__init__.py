"""The reference engine: a Llama-style decoder on the paged KV arena, and the scheduler that drives it.

Knows the node's blocks and the arena (store/), model/ and contract/ (sampling parameters); nothing
of etcd, HTTP, transfer or deployment.
"""
