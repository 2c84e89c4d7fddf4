"""The node core's exchange (prefixpool/node/exchange.py): fetch from a real peer over 127.0.0.1, publish placement.

The publisher is a hand-written recorder (etcd is the cluster tests' business): after every step the
test compares what was published with where the blocks really are. A failed fetch never raises: it
holds nothing, keeps the intact prefix cached, and publishes what it stored and evicted.
"""

import asyncio

import pytest

from prefixpool.node.exchange import BlockExchange, Fetched
from prefixpool.node.faults import Fault, FaultySource
from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tier_names import DEVICE
from prefixpool.transfer import Fetcher, serve
from prefixpool.transfer.source import BlockSource
from tests.support.blocks import commit_random

NAMESPACE = Namespace("exchange")
KEYS = chain_ids(range(6), NAMESPACE)
SHAPE = (2, 4, 2, 8)  # layers, block size, kv heads, head dim: 1 KiB blocks
HANG_GUARD_S = 60.0


class Recorded:
    """The publisher's side: the latest tier of every key (None: deleted)."""

    def __init__(self) -> None:
        self.tier: dict[bytes, str | None] = {}

    def publish(self, stored=(), removed=(), tier=DEVICE, tails=None) -> None:
        self.tier.update((key, tier) for key in stored)
        self.tier.update((key, None) for key in removed)


def node(num_blocks: int, min_residency_s: float = 0.0) -> tuple[NodeBlocks, KVArena]:
    return NodeBlocks(BlockPool(num_blocks, min_residency_s)), KVArena(ArenaShape(num_blocks, *SHAPE))


def fetch_from_peer(blocks: NodeBlocks, arena: KVArena, peer_keys, *, deadline_s: float = HANG_GUARD_S,
                    gone: bool = False, source=BlockSource, **source_args) -> tuple[Fetched, Recorded]:
    """One exchange.fetch of KEYS from a peer on 127.0.0.1 holding `peer_keys` (gone: closed first)."""
    async def scenario():
        peer, peer_arena = node(8)
        commit_random(peer, peer_arena, peer_keys)
        server = await serve(peer, peer_arena, "tcp://127.0.0.1:0", source=source(peer, peer_arena, **source_args))
        url = server.url
        if gone:
            await server.close()
        recorded, fetcher = Recorded(), Fetcher()
        try:
            return await BlockExchange(blocks, arena, recorded, fetcher).fetch(url, KEYS, deadline_s), recorded
        finally:
            await fetcher.close()
            if not gone:
                await server.close()
            peer.check_integrity()
            assert sum(peer.pool.ref_count) == 0

    return asyncio.run(scenario())


def test_a_fetch_holds_what_arrived_and_publishes_it_where_it_is():
    blocks, arena = node(8)
    fetched, recorded = fetch_from_peer(blocks, arena, KEYS[:4])
    assert fetched.num_blocks == 4 and fetched.num_bytes == 4 * arena.block_bytes  # the peer had 4
    assert len(fetched.hold.block_ids) == 4 and all(blocks.pool.ref_count[b] == 1 for b in fetched.hold.block_ids)
    assert recorded.tier == {key: DEVICE for key in KEYS[:4]}
    blocks.release(fetched.hold)
    blocks.check_integrity()


def test_a_fetch_that_fails_holds_nothing_keeps_the_intact_prefix_and_publishes_evictions():
    blocks, arena = node(4)
    old = chain_ids(range(100, 104), NAMESPACE)
    commit_random(blocks, arena, old)  # a full pool: the fetch evicts these
    fetched, recorded = fetch_from_peer(blocks, arena, KEYS, deadline_s=1.0, source=FaultySource,
                                       fault=lambda: Fault("stall", 2))  # 2 blocks, then past the deadline
    assert fetched.hold is None and fetched.num_blocks == 2 and fetched.num_bytes == 2 * arena.block_bytes
    assert [blocks.lookup(key) is not None for key in KEYS[:3]] == [True, True, False]
    assert sum(blocks.pool.ref_count) == 0
    evicted = [key for key in old if blocks.lookup(key) is None]
    assert evicted and recorded.tier == {**{key: DEVICE for key in KEYS[:2]}, **{key: None for key in evicted}}
    blocks.check_integrity()


def test_an_unreachable_peer_costs_a_recompute_not_an_error():
    blocks, arena = node(4)
    fetched, recorded = fetch_from_peer(blocks, arena, KEYS, gone=True)
    assert (fetched.hold, fetched.num_blocks, recorded.tier) == (None, 0, {})
    blocks.check_integrity()


def test_a_pool_within_its_minimum_residency_costs_a_recompute_not_an_error():
    blocks, arena = node(4, min_residency_s=3600.0)
    commit_random(blocks, arena, chain_ids(range(200, 204), NAMESPACE))
    fetched, recorded = fetch_from_peer(blocks, arena, KEYS)
    assert (fetched.hold, fetched.num_blocks, recorded.tier) == (None, 0, {})
    blocks.check_integrity()


@pytest.mark.parametrize("drop", [False, True])
def test_publish_names_each_key_s_tier_now_or_deletes_it(drop):
    blocks, arena = node(4)
    commit_random(blocks, arena, KEYS[:2])
    if drop:
        assert blocks.pool.drop(KEYS[1])
    recorded = Recorded()
    BlockExchange(blocks, arena, recorded, Fetcher()).publish(KEYS[:3])
    assert recorded.tier == {KEYS[0]: DEVICE, KEYS[1]: None if drop else DEVICE, KEYS[2]: None}
