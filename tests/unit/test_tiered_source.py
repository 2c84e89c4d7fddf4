"""The transfer server of a tiered node serves blocks from any tier: a peer's fetch of a run that
sits in host memory and on the SSD gets every block, byte for byte, and the holder notes what it
promoted for publishing."""

import asyncio

import torch

from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import TierChain
from prefixpool.transfer import fetch, serve

SHAPE = ArenaShape(num_blocks=8, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def test_fetch_serves_host_and_ssd_blocks(tmp_path):
    asyncio.run(_fetch_from_lower_tiers(tmp_path))


async def _fetch_from_lower_tiers(tmp_path):
    arena = KVArena(SHAPE)
    disk = DiskTier(tmp_path, arena.block_bytes, 16)
    tiers = NodeBlocks(BlockPool(8), TierChain(arena, HostTier(4, arena.block_bytes), disk))
    keys = chain_ids(list(range(6)), Namespace("m", block_size=4))
    payloads = [torch.full((arena.block_bytes,), i + 1, dtype=torch.uint8) for i in range(6)]
    for key, payload in zip(keys[:3], payloads[:3]):
        tiers.tiers.host.put(key, payload)
    for key, payload in zip(keys[3:], payloads[3:]):
        disk.put(key, payload)
    disk.flush()
    tiers.collect()
    tiers.take_changes()
    server = await serve(tiers, arena)  # the plain source: it promotes through the node's blocks
    receiver_pool, receiver_arena = NodeBlocks(BlockPool(8)), KVArena(SHAPE)
    try:
        result = await fetch(server.url, keys, receiver_pool, receiver_arena, deadline_s=5.0)
    finally:
        await server.close()
        disk.close()
    assert result.keys == keys
    for block_id, payload in zip(result.block_ids, payloads):
        assert bytes(receiver_arena.read_bytes(block_id)) == bytes(payload.numpy())
    receiver_pool.release(result.hold)
    receiver_pool.check_integrity()
    stored, removed = tiers.placement(tiers.take_changes().keys())
    assert stored == {"device": keys} and removed == []
    tiers.check_integrity()
