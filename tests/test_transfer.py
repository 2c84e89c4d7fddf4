"""The transfer layer end to end over real sockets on 127.0.0.1, once per transport.

Every test drives a real server and a real fetch; faults are injected by
hand-written BlockSource subclasses on the holder. After every fetch the
receiver's pool passes check_integrity and holds no pins but the returned ones.
"""

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from store.arena import ArenaShape, KVArena  # noqa: E402
from store.keys import Namespace, chain_ids  # noqa: E402
from store.pool import BlockPool  # noqa: E402
from transfer import (  # noqa: E402
    BadPeerUrl,
    Fetcher,
    PeerUnreachable,
    TransferTimeout,
    Unauthorized,
    fetch,
    serve,
)
from transfer.source import BlockSource  # noqa: E402

TRANSPORTS = ["tcp", "ucx"]
SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)  # 1 KiB blocks


def keys_for(count, start=0, model="m"):
    return chain_ids(range(start, start + count), Namespace(model))


def node(num_blocks, **shape):
    dims = {**SHAPE, **shape}
    return BlockPool(num_blocks), KVArena(ArenaShape(num_blocks, **dims))


def hold(pool, arena, keys, seed=0):
    """Commit random bytes under `keys` in the holder's pool (cached, unpinned); returns them."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    allocation = pool.allocate(len(keys))
    for key, block_id in zip(keys, allocation.block_ids):
        data = torch.randint(0, 256, (arena.block_bytes,), dtype=torch.uint8, generator=generator)
        arena.write_bytes(block_id, data.numpy().tobytes())
        assert pool.commit(block_id, key)
        blocks.append(data.numpy().tobytes())
    pool.free(allocation.block_ids)
    return blocks


def assert_received(result, pool, arena, keys, blocks):
    assert result.keys == keys[: len(result.keys)]
    assert len(result.block_ids) == len(result.keys)
    for key, block_id, data in zip(result.keys, result.block_ids, blocks):
        assert bytes(arena.read_bytes(block_id)) == data
        assert pool.lookup(key) == block_id
        assert pool.ref_count[block_id] == 1
    pool.check_integrity()


def release(result, pool):
    pool.free(result.block_ids)
    pool.check_integrity()
    assert sum(pool.ref_count) == 0


def url(transport):
    return f"{transport}://127.0.0.1:0"


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("count,shape", [(1, {}), (7, {"head_dim": 1}), (33, {"num_layers": 3}), (5, {"block_size": 64})])
def test_bytes_received_equal_bytes_sent(transport, count, shape):
    async def run():
        holder_pool, holder_arena = node(count + 3, **shape)
        keys = keys_for(count)
        blocks = hold(holder_pool, holder_arena, keys, seed=count)
        server = await serve(holder_pool, holder_arena, url(transport))
        pool, arena = node(count + 5, **shape)
        try:
            result = await fetch(server.url, keys, pool, arena, deadline_s=10)
        finally:
            await server.close()
        assert result.num_blocks == count and result.num_bytes == count * arena.block_bytes
        assert_received(result, pool, arena, keys, blocks)
        release(result, pool)
        assert sum(holder_pool.ref_count) == 0
        holder_pool.check_integrity()

    asyncio.run(run())
