"""Helpers shared by the engine tests (not a test module): engines over fresh pools, checks."""

import random

from cluster.engine.scheduler import Engine
from cluster.engine.model_config import arena_shape_for, namespace_for
from store.arena import KVArena
from store.pool import BlockPool

BLOCK = 4


def make_engine(model, num_blocks=64, chunk_size=512, max_batch_size=8):
    config = model.config
    arena = KVArena(arena_shape_for(config, num_blocks, BLOCK), model.dtype)
    return Engine(model, BlockPool(num_blocks), arena, namespace_for(config, model.dtype, BLOCK),
                  chunk_size=chunk_size, max_batch_size=max_batch_size)


def assert_clean(engine):
    engine.pool.check_integrity()
    assert not engine.has_work()
    assert engine.pool.ref_count == [0] * engine.pool.num_blocks, "leaked ref counts"


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def copy_blocks(source, target, keys):
    """What a network transfer does: raw bytes of each cached block into a fresh block elsewhere."""
    block_ids = [source.pool.lookup(key) for key in keys]
    allocation = target.pool.allocate(len(block_ids))
    for src, dst, key in zip(block_ids, allocation.block_ids, keys):
        target.arena.write_bytes(dst, bytes(source.arena.read_bytes(src)))
        assert target.pool.commit(dst, key)
    target.pool.free(allocation.block_ids)
