"""Helpers shared by the engine tests (not a test module): engines over fresh pools, checks.

PREFIXPOOL_TEST_DEVICE names the torch device the engine tests that read DEVICE run on: cpu (the
default), or cuda on the GPU machine (scripts/gpu_check.sh). An engine's arena is on its model's device."""

import os
import random

from prefixpool.engine.scheduler import Engine
from prefixpool.engine.torch_dtype import dtype_name
from prefixpool.model.config import arena_shape_for, namespace_for
from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool

BLOCK = 4
DEVICE = os.environ.get("PREFIXPOOL_TEST_DEVICE", "cpu")


def make_engine(model, num_blocks=64, chunk_size=512, max_batch_size=8, batch_invariant=False):
    config = model.config
    arena = KVArena(arena_shape_for(config, num_blocks, BLOCK), model.dtype, model.device)
    namespace = namespace_for(config, dtype_name(model.dtype), BLOCK)
    return Engine(model, NodeBlocks(BlockPool(num_blocks)), arena, namespace, chunk_size=chunk_size,
                  max_batch_size=max_batch_size, batch_invariant=batch_invariant)


def assert_clean(engine):
    engine.blocks.check_integrity()
    assert not engine.has_work()
    assert engine.blocks.pool.ref_count == [0] * engine.blocks.num_blocks, "leaked ref counts"


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def copy_blocks(source, target, keys):
    """What a network transfer does: raw bytes of each cached block into a fresh block elsewhere."""
    block_ids = [source.blocks.lookup(key) for key in keys]
    hold = target.blocks.acquire(())
    target.blocks.allocate(hold, len(block_ids))
    for index, (src, dst, key) in enumerate(zip(block_ids, list(hold.block_ids), keys)):
        target.arena.write_bytes(dst, bytes(source.arena.read_bytes(src)))
        assert target.blocks.commit(hold, index, [key]) == [key]
    target.blocks.release(hold)
