"""A server's startup heap kept out of the cyclic garbage collector's full passes.

After a server has imported its libraries and built its tables (the tokenizer, aiohttp, gRPC, torch),
most of its objects live as long as the process. Each full collection (generation 2) walks all of them:
measured in a router behind the gateway benchmark, 15-19 ms with the event loop stopped, and every request
in flight waits that long (benchmarks/gateway.md). `gc.freeze()` moves what is alive at startup to a
permanent generation that collections skip; what the server allocates later is collected as before. With
`--processes N` each spawned router process freezes its own heap (nothing is forked, nothing shared).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survives; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
