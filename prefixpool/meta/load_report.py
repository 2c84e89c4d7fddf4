"""A node's load in its etcd record: sampled often, put when it changes, else refreshed now and then.

    every period_s:  sample() -> Load(num_queued, num_running, prefill tokens/s), or None (no answer)
                     counts changed, or refresh_s since the last put -> membership.update_load(...)
    None:            nothing is put; the record keeps its last load and that load's load_time

Our worker samples its engine; the vLLM sidecar samples vLLM's /metrics. Every
router reads the same record, so they agree on load no router sent. Knows
nothing of what is sampled.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, NamedTuple, Protocol


class Load(NamedTuple):
    num_queued: int
    num_running: int
    prefill_tokens_per_s: float = 0.0


class LoadSink(Protocol):  # prefixpool.meta.membership.Membership
    def update_load(self, num_queued: int, num_running: int, prefill_tokens_per_s: float) -> None: ...


async def report_load(sample: Callable[[], Awaitable[Load | None]], membership: LoadSink,
                      period_s: float = 0.05, refresh_s: float = 1.0) -> None:
    """Until cancelled."""
    last, last_sent = None, 0.0
    while True:
        await asyncio.sleep(period_s)
        load = await sample()
        if load is None:
            continue
        counts = (load.num_queued, load.num_running)
        if counts != last or time.monotonic() - last_sent > refresh_s:
            membership.update_load(*load)
            last, last_sent = counts, time.monotonic()
