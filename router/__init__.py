"""The cache-aware router: OpenAI-compatible API, block index mirror lookups and policies.

Imports `store` (keys) and `transfer` only if it must.
"""
