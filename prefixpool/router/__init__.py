"""The cache-aware router: OpenAI-compatible API, block-index lookups, policies and the cost model.

Knows store/ (keys), meta/ (the index and fleet load it reads), contract/ and model/ (tokenizer);
nothing of the engine, the worker or deployment.
"""
