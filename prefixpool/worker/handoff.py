"""The decode node's side of a prefill/decode handoff: fetch a prompt's blocks while the prefill node computes them.

    received = await receive(exchange, keys, peer_url, end, wait_s=..., fetch_timeout_s=...)

    prefill node:  chunk 1 ─ commit ─ chunk 2 ─ commit ─ ... ─ chunk k ─ commit      (publishes each block)
    decode node:        fetch [0, b1) ─ fetch [b1, b2) ─ ... ─ fetch [.., end)        (holds each as it lands)
                   ├──────── wait_s without a new block: stop, compute the rest ────┤

Each round asks the prefill node for every block from the first one this node lacks up to `end`;
its transfer source serves the longest run it has committed so far (and stops there), so a round
moves what appeared since the last one. A round that brings nothing waits `poll_s` and asks again,
until no block came for `wait_s` seconds (or at once when this node has no free block to receive
into). A failed round (the prefill node died, stalled past the
fetch deadline, or sent a block whose checksum fails) ends the handoff at once: whatever did not
arrive intact is computed here, so a failure costs time, never a wrong answer. The partial last
block of a prompt has no key and is never moved: the decode node computes those tokens (fewer than
a block, and at least the prompt's last token, whose logits it needs). Knows nothing of HTTP, the
router or the engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from prefixpool.node.exchange import BlockExchange
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import Hold

POLL_S = 0.005


@dataclass
class Received:
    holds: list[Hold] = field(default_factory=list)  # the caller releases them when the request ends
    num_blocks: int = 0  # blocks that arrived intact and are held
    num_bytes: int = 0
    num_rounds: int = 0
    complete: bool = False  # every block up to `end` is here (held or already local)


async def receive(exchange: BlockExchange, keys: Sequence[BlockKey], peer_url: str, end: int, *, wait_s: float,
                  fetch_timeout_s: float, poll_s: float = POLL_S,
                  clock: Callable[[], float] = time.monotonic) -> Received:
    """Blocks [first missing, end) of `keys` from the prefill node at `peer_url`, as it commits them."""
    received = Received()
    last_progress = clock()
    while (local := len(exchange.blocks.match(keys[:end]))) < end:
        fetched = await exchange.fetch(peer_url, keys[local:end], fetch_timeout_s, partial_ok=True)
        received.num_rounds += 1
        received.num_bytes += fetched.num_bytes
        if fetched.hold is None:  # dead, stalled or damaged: compute the rest here
            return received
        if not fetched.num_blocks:
            exchange.blocks.release(fetched.hold)
            if not exchange.blocks.num_free:  # every block here is held: nothing can land until the end
                return received
        else:
            received.holds.append(fetched.hold)
            received.num_blocks += fetched.num_blocks
            last_progress = clock()
            continue
        if clock() - last_progress > wait_s:
            return received
        await asyncio.sleep(poll_s)
    received.complete = True
    return received


@dataclass
class HandoffStats:
    """What this node received as a decode node, for /debug/pool (the router keeps the Prometheus side)."""

    num_handoffs: int = 0
    num_rounds: int = 0  # fetches asked of prefill nodes: more rounds than handoffs is the transfer overlapping
    num_incomplete: int = 0  # the prefill node died, stalled or sent damage: the rest was computed here
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def observe(self, received: Received, seconds: float) -> None:
        self.num_handoffs += 1
        self.num_rounds += received.num_rounds
        self.num_incomplete += not received.complete
        self.num_blocks += received.num_blocks
        self.num_bytes += received.num_bytes
        self.seconds += seconds

    def report(self) -> dict:
        return {"num_handoffs": self.num_handoffs, "num_rounds": self.num_rounds, "num_incomplete": self.num_incomplete,
                "num_blocks": self.num_blocks, "num_bytes": self.num_bytes, "seconds": round(self.seconds, 6)}
