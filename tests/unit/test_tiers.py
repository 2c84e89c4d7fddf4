"""The tier chain: demote on eviction, promote before matching, bytes identical, restart warm."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier
from prefixpool.store.keys import Namespace, chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import TierChain, TierHits

NS = Namespace("tiers", block_size=1)
SHAPE = dict(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4)


def make(num_device, num_host, num_disk, directory=None, residency=0.0):
    arena = KVArena(ArenaShape(num_device, **SHAPE))
    pool = BlockPool(num_device, min_residency_s=residency)
    host = HostTier(num_host, arena.block_bytes, pin_memory=False) if num_host else None
    disk = DiskTier(directory, arena.block_bytes, num_disk) if num_disk else None
    return NodeBlocks(pool, TierChain(arena, host, disk))


def kv_of(key) -> torch.Tensor:
    """Deterministic KV for a key, so any copy can be checked against it."""
    seed = int.from_bytes(key[:4], "little")
    return torch.randn(SHAPE["num_layers"], 2, SHAPE["block_size"], 1, 4, generator=torch.Generator().manual_seed(seed))


def compute(tiered, keys):
    """What the engine does: promote, acquire, allocate the rest, write real KV, commit, release."""
    changes = [tiered.promote(keys)]
    tiered.take_changes()
    arena = tiered.tiers.arena
    hold = tiered.acquire(keys)
    hit = list(hold.block_ids)
    for block_id, key in zip(hit, keys):
        assert torch.equal(arena.view(block_id), kv_of(key)), "a hit returned wrong KV"
    tiered.allocate(hold, len(keys) - len(hit))
    changes.append(tiered.take_changes())
    for index in range(len(hit), len(keys)):
        arena.view(hold.block_ids[index]).copy_(kv_of(keys[index]))
    tiered.commit(hold, len(hit), keys[len(hit):])
    tiered.release(hold)
    check(tiered)
    return len(hit), changes


def check(tiered):
    tiered.check_integrity()
    if tiered.tiers.host is not None:
        tiered.tiers.host.check_integrity()
        assert not set(tiered.tiers.host.index) & set(tiered.pool.index), "host is exclusive of the device"


def test_demote_then_promote_returns_identical_bytes(tmp_path):
    tiered = make(2, 2, 0)
    a, b = chain([1, 2], NS), chain([3, 4], NS)
    compute(tiered, a)
    _, changes = compute(tiered, b)  # evicts a (tail first) to host
    assert changes[1].removed["device"] == [a[1], a[0]] and changes[1].stored["host"] == [a[1], a[0]]
    assert tiered.tier_hits(a) == TierHits(0, 2, 0)
    changes = tiered.promote(a)
    assert changes.stored["device"] == a and changes.removed["host"] == a
    assert sorted(changes.stored["host"]) == sorted(b)  # b went down to make room
    for block_id, key in zip(tiered.pool.match(a), a):
        assert torch.equal(tiered.tiers.arena.view(block_id), kv_of(key))
    check(tiered)


def test_host_victims_go_to_ssd_and_come_back_identical(tmp_path):
    tiered = make(2, 2, 16, tmp_path)
    prompts = [chain([10 * i, 10 * i + 1], NS) for i in range(4)]
    for keys in prompts:
        compute(tiered, keys)
    tiered.tiers.disk.flush()
    assert sorted(tiered.collect().stored["disk"]) == sorted(prompts[0] + prompts[1])
    assert tiered.tier_hits(prompts[0]) == TierHits(0, 0, 2)
    assert tiered.tier_hits(prompts[2]) == TierHits(0, 2, 0)
    hit, _ = compute(tiered, prompts[0])  # asserts the bytes inside
    assert hit == 2
    assert tiered.tier_of(prompts[0][0]) == "device"
    tiered.tiers.disk.close()


def test_clear_forgets_every_unheld_block_in_every_tier_and_keeps_the_held_ones(tmp_path):
    """vLLM's reset of the connector's cache (new weights): nothing stale may come back from any tier."""
    tiered = make(2, 2, 16, tmp_path)
    prompts = [chain([10 * i, 10 * i + 1], NS) for i in range(4)]  # device 3, host 2, SSD 0 and 1
    for keys in prompts:
        compute(tiered, keys)
    tiered.tiers.disk.flush()
    assert len(list(tmp_path.glob("*.blk"))) == 4
    tiered.tiers.disk.put(chain([99], NS)[0], kv_of(b"\0" * 16).reshape(-1).view(torch.uint8))  # a queued write
    held = tiered.acquire(prompts[3][:1])
    tiered.take_changes()
    cleared = tiered.clear()
    everything = {key for keys in prompts for key in keys} | {chain([99], NS)[0]}
    assert set(cleared) == everything - {prompts[3][0]}
    assert ({key: tiered.tier_of(key) for key in everything}
            == {key: None for key in everything} | {prompts[3][0]: "device"})
    assert sorted(tiered.take_changes().keys()) == sorted(cleared)  # journalled, for the publisher
    assert list(tmp_path.glob("*.blk")) == []  # the queued write landed first, then went with the rest
    for keys in prompts[:3]:
        assert tiered.tier_hits(keys).total == 0
    tiered.release(held)
    check(tiered)
    hit, _ = compute(tiered, prompts[0])  # computed again, from nothing
    assert hit == 0
    tiered.tiers.disk.close()


def test_a_corrupt_ssd_block_is_a_miss_and_is_recomputed(tmp_path):
    tiered = make(2, 0, 8, tmp_path)  # no host tier: the device demotes straight to SSD
    assert tiered.tiers.host is None and [t.name for t in tiered.tiers.lower] == ["disk"]
    a, b = chain([1, 2], NS), chain([3, 4], NS)
    compute(tiered, a)
    compute(tiered, b)
    tiered.tiers.disk.flush()
    path = tiered.tiers.disk.path(a[1])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(raw)
    hit, changes = compute(tiered, a)  # bytes of every hit are checked inside
    assert hit == 1 and changes[0].stored["device"] == [a[0]]
    assert a[1] in tiered.collect().removed["disk"]
    tiered.tiers.disk.close()


def test_restart_over_the_same_directory_hits_again(tmp_path):
    first = make(2, 1, 8, tmp_path)
    keys = chain([5, 6, 7, 8], NS)
    compute(first, keys[:2])
    compute(first, keys[2:])
    compute(first, chain([9, 9], NS))
    first.tiers.disk.flush()
    on_disk = set(first.tiers.disk.index)
    first.tiers.disk.close()
    second = make(2, 1, 8, tmp_path)  # a restarted worker: empty device and host
    assert set(second.tiers.disk.scan()) == on_disk and len(on_disk) >= 3
    assert second.tier_hits(keys).disk >= 1
    hit, _ = compute(second, keys[:2])
    assert hit == 2 - sum(k not in on_disk for k in keys[:2])
    second.tiers.disk.close()


def test_promotion_under_full_protection_promotes_nothing_and_still_answers(tmp_path):
    tiered = make(2, 2, 0)
    a, b = chain([1, 2], NS), chain([3, 4], NS)
    compute(tiered, a)
    compute(tiered, b)
    tiered.pin("b", b, ttl_s=60.0)  # every device block is held
    assert tiered.promote(a).stored == {}
    assert tiered.tier_hits(a) == TierHits(0, 2, 0)
    tiered.pin("b", b[:1], ttl_s=60.0)  # b[1] unpinned, one block free: a partial promotion
    assert tiered.promote(a).stored["device"] == [a[0]]
    assert tiered.tier_hits(a) == TierHits(1, 1, 0)
    check(tiered)


def test_promote_extends_the_device_prefix_without_evicting_it():
    tiered = make(3, 4, 0)
    keys = chain([1, 2, 3], NS)
    compute(tiered, keys)
    compute(tiered, chain([7, 8], NS))  # leaves keys[0] on the device, keys[1:] in host
    assert tiered.tier_hits(keys) == TierHits(1, 2, 0)
    tiered.promote(keys)
    assert tiered.tier_hits(keys) == TierHits(3, 0, 0)
    check(tiered)


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=20))
def test_any_request_sequence_returns_right_kv_from_any_tier(tmp_path_factory, requests):
    tiered = make(3, 2, 4, tmp_path_factory.mktemp("disk"))
    try:
        for tokens in requests:
            compute(tiered, chain(tokens, NS))  # checks every hit's bytes and the integrity
    finally:
        tiered.tiers.disk.close()
