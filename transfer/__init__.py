"""Moving KV blocks between nodes: one framed protocol over TCP and UCX.

Imports only `store`.
"""
