"""The engine on a tiered pool, in one process: evicted blocks are demoted, promoted back before
admission, and the output equals a cold recompute; residency and pins never hang the engine."""

import random

import pytest

from prefixpool.engine.checkpoint import random_model
from prefixpool.engine.scheduler import Engine
from prefixpool.engine.torch_dtype import dtype_name
from prefixpool.model.config import arena_shape_for, namespace_for, preset
from prefixpool.engine.sampling import SamplingParams
from prefixpool.store.arena import KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier
from prefixpool.store.keys import chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import NoTiers, TierChain

BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_engine(model, num_blocks=16, host_blocks=0, disk_dir=None, min_residency_s=0.0, clock=None):
    config = model.config
    arena = KVArena(arena_shape_for(config, num_blocks, BLOCK), model.dtype)
    pool = BlockPool(num_blocks, min_residency_s, clock or Clock())
    host = HostTier(host_blocks, arena.block_bytes) if host_blocks else None
    disk = DiskTier(disk_dir, arena.block_bytes, 256) if disk_dir else None
    tiers = NodeBlocks(pool, TierChain(arena, host, disk) if (host, disk) != (None, None) else None)
    engine = Engine(model, tiers, arena, namespace_for(config, dtype_name(model.dtype), BLOCK))
    return engine, tiers, tiers.take_changes


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def cold_output(model, prompt):
    engine, _, _ = make_engine(model, num_blocks=32)
    return engine.generate(prompt, GREEDY)[0]


def flush_device(engine, seed):
    """Run distinct prompts until the device pool has been turned over."""
    for i in range(3):
        engine.generate(tokens(40, seed + i), GREEDY)


def test_plain_allocator_is_the_default(model):
    config = model.config
    blocks = NodeBlocks(BlockPool(8))
    engine = Engine(model, blocks, KVArena(arena_shape_for(config, 8, BLOCK), model.dtype),
                    namespace_for(config, dtype_name(model.dtype), BLOCK))
    assert isinstance(engine.blocks.tiers, NoTiers)  # allocation is the pool's: nothing is demoted


def test_prefix_promoted_from_host_equals_recompute(model):
    engine, tiers, changes = make_engine(model, host_blocks=64)
    prompt = tokens(33, seed=7)
    keys = chain(prompt, engine.namespace)
    first, _ = engine.generate(prompt, GREEDY)
    flush_device(engine, seed=100)
    assert tiers.tier_hits(keys).host == len(keys), "the prompt's blocks were demoted to host"
    assert changes().stored.get("host")
    promoted = tiers.promote(keys)
    assert promoted.stored["device"] == keys and promoted.removed["host"] == keys
    again, stats = engine.generate(prompt, GREEDY)
    assert stats.num_cached_tokens == len(keys) * BLOCK
    assert again == first == cold_output(model, prompt)
    tiers.check_integrity()
    tiers.tiers.host.check_integrity()


def test_prefix_promoted_from_disk_equals_recompute(model, tmp_path):
    engine, tiers, _ = make_engine(model, disk_dir=tmp_path)
    prompt = tokens(33, seed=8)
    keys = chain(prompt, engine.namespace)
    first, _ = engine.generate(prompt, GREEDY)
    flush_device(engine, seed=200)
    tiers.tiers.disk.flush()
    assert tiers.tier_hits(keys).disk == len(keys)
    assert set(keys) <= set(tiers.collect().stored["disk"])
    tiers.promote(keys)
    again, stats = engine.generate(prompt, GREEDY)
    assert stats.num_cached_tokens == len(keys) * BLOCK and again == first
    tiers.close()


def test_truncated_disk_block_is_recomputed(model, tmp_path):
    engine, tiers, _ = make_engine(model, disk_dir=tmp_path)
    prompt = tokens(33, seed=9)
    keys = chain(prompt, engine.namespace)
    first, _ = engine.generate(prompt, GREEDY)
    flush_device(engine, seed=300)
    tiers.tiers.disk.flush()
    path = tiers.tiers.disk.path(keys[3])
    path.write_bytes(path.read_bytes()[:100])
    promoted = tiers.promote(keys)
    assert promoted.stored["device"] == keys[:3], "the run ends at the truncated block"
    assert keys[3] in tiers.collect().removed["disk"]
    again, stats = engine.generate(prompt, GREEDY)
    assert stats.num_cached_tokens == 3 * BLOCK and again == first
    tiers.close()


def test_residency_makes_admission_wait_then_proceed(model):
    clock = Clock()
    engine, tiers, _ = make_engine(model, num_blocks=12, min_residency_s=10.0, clock=clock)
    engine.generate(tokens(40, seed=1), GREEDY)  # 11 blocks, all resident for 10 s
    engine.submit(tokens(40, seed=2), GREEDY)
    assert not engine.schedule().spans and engine.num_queued == 1, "waits: the free blocks are resident"
    assert engine.take_refused() == []
    clock.now = 11.0
    while engine.has_work():
        engine.step()
    tiers.check_integrity()


def test_pins_holding_the_pool_refuse_with_a_clear_reason(model):
    engine, tiers, _ = make_engine(model, num_blocks=12)
    prompt = tokens(40, seed=3)
    engine.generate(prompt, GREEDY)
    engine.blocks.pin("prompt", chain(prompt, engine.namespace), ttl_s=60)
    request_id = engine.submit(tokens(40, seed=4), GREEDY)
    assert not engine.schedule().spans and not engine.has_work()
    [(refused_id, reason)] = engine.take_refused()
    assert refused_id == request_id and "pinned" in reason
    tiers.check_integrity()
