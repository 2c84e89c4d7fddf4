"""A node's blocks and the cluster: fetch a prefix from a peer, publish where each block is now.

    fetched = await exchange.fetch(peer_url, keys, deadline_s)
        ok       Fetched(hold, n, bytes): keys[:n] arrived intact, committed, held by `hold`
                 until the caller releases it (n may be < len(keys): the peer evicted, a
                 checksum failed, the pool filled up)
        failed   Fetched(None, n, bytes): the peer was unreachable, too slow or refused us, or
                 the free blocks are within their minimum residency; the n blocks that arrived
                 before the failure stay cached, unheld. Never raises: the caller recomputes.
        either way every block it stored or evicted is published
    exchange.publish(keys)         each key in the fastest tier that holds it now, or deleted where none does
    exchange.publish(keys, tails)  ... naming each stored chain's last key (run-granular publication: meta/runs.py)
    exchange.publish_changes()     every key whose tier changed since last asked (promote, demote, SSD writes)
    exchange.collect()             SSD writes finished in the background -> published

Publishing is by key, not by event: a node advertises each block once, in the
fastest tier holding it (etcd's `/blocks/<key>/<node>` has one value), so for
every key touched the exchange asks where it is now (`blocks.placement`) and
puts that tier, or deletes the key when no tier holds it. Runs on the event
loop's thread, as every block operation must. Knows nothing of etcd's
connection, the transfer server, engines or vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Iterable, Protocol, Sequence

from prefixpool.meta.publisher import PublishesBlocks, publish_placement
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import Hold, NodeBlocks
from prefixpool.store.pool import PoolExhausted
from prefixpool.transfer.errors import TransferError
from prefixpool.transfer.sink import FetchResult

log = logging.getLogger(__name__)


class FetchesBlocks(Protocol):
    async def fetch(self, peer_url: str, keys: Sequence[BlockKey], blocks: NodeBlocks, arena: KVArena, *,
                    deadline_s: float) -> FetchResult: ...  # fmt: skip


@dataclass(frozen=True)
class Fetched:
    hold: Hold | None  # the fetched blocks, held until the caller releases them; None: the fetch failed
    num_blocks: int  # keys[:num_blocks] arrived intact and are cached here
    num_bytes: int


class BlockExchange:
    def __init__(self, blocks: NodeBlocks, arena: KVArena, publisher: PublishesBlocks,
                 fetcher: FetchesBlocks) -> None:  # fmt: skip
        self.blocks, self.arena, self.publisher, self.fetcher = blocks, arena, publisher, fetcher

    async def fetch(self, peer_url: str, keys: Sequence[BlockKey], deadline_s: float,
                    partial_ok: bool = False) -> Fetched:
        """The longest prefix of `keys` the peer still holds, into this node's blocks (see the module doc).
        `partial_ok`: a short answer is expected (a prefill node still computing the rest), not worth a warning."""
        try:
            result = await self.fetcher.fetch(peer_url, keys, self.blocks, self.arena, deadline_s=deadline_s)
        except TransferError as err:
            stored, evicted = list(err.stored or ()), list(err.evicted or ())
            log.warning("fetch of %d blocks from %s failed (%s): %d arrived intact; recomputing the rest",
                        len(keys), peer_url, err, len(stored))
            self.publish([*stored, *evicted])
            return Fetched(None, len(stored), len(stored) * self.arena.block_bytes)
        except PoolExhausted as err:  # the free blocks are within their minimum residency
            log.info("no room to fetch from %s (%s); recomputing", peer_url, err)
            return Fetched(None, 0, 0)
        if result.num_blocks < len(keys) and not partial_ok:
            log.warning("fetch from %s: %d of %d blocks arrived intact", peer_url, result.num_blocks, len(keys))
        self.publish([*result.keys, *result.evicted])
        return Fetched(result.hold, result.num_blocks, result.num_bytes)

    def publish(self, keys: Iterable[BlockKey], tails: Collection[BlockKey] | None = None) -> None:
        """Each key in the fastest tier that holds it now, or deleted when none does; `tails`: the stored chains'
        last keys when the keys are several chains (None: the last key stored in each tier ends the one chain)."""
        keys = list(keys)
        if keys:
            publish_placement(self.publisher, self.blocks.placement(keys), tails)

    def publish_changes(self) -> None:
        self.publish(self.blocks.take_changes().keys())

    def collect(self) -> None:
        self.blocks.collect()
        self.publish_changes()
