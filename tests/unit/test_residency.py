"""Minimum residency in the block pool, driven by a hand-set clock (no sleeps)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.store.keys import Namespace, chain
from prefixpool.store.pool import BlockPool, PoolExhausted

NS = Namespace("residency", block_size=1)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fill(pool, keys):
    alloc = pool.allocate(len(keys))
    for block_id, key in zip(alloc.block_ids, keys):
        assert pool.commit(block_id, key)
    pool.free(alloc.block_ids)
    pool.check_integrity()
    return alloc


def test_off_by_default_keeps_plain_lru():
    pool = BlockPool(2)
    keys = chain([1, 2], NS)
    fill(pool, keys)
    assert pool.allocate(2).evicted == [keys[1], keys[0]]
    pool.check_integrity()


def test_resident_blocks_are_skipped_for_older_ones():
    clock = Clock()
    pool = BlockPool(4, min_residency_s=10.0, clock=clock)
    old = chain([1, 2], NS)
    fill(pool, old)
    clock.now += 11.0  # the old prefix's residency has passed
    new = chain([7, 8], NS)
    fill(pool, new)  # uses the two keyless blocks
    alloc = pool.allocate(2)  # head of the queue is `old`, evictable
    pool.check_integrity()
    assert set(alloc.evicted) == set(old)
    assert len(pool.match(new)) == 2
    pool.free(alloc.block_ids)
    pool.check_integrity()


def test_a_burst_of_distinct_prefixes_cannot_flush_a_resident_prefix():
    clock = Clock()
    pool = BlockPool(6, min_residency_s=30.0, clock=clock)
    expensive = chain([5, 5, 5, 5], NS)
    fill(pool, expensive)
    refused = 0
    for i in range(20):  # a burst of distinct one-block prefixes, all within the window
        clock.now += 1.0
        try:
            fill(pool, chain([1000 + i], NS))
        except PoolExhausted:
            refused += 1  # the caller recomputes without caching; nothing is evicted
        pool.check_integrity()
        assert len(pool.match(expensive)) == 4
    assert refused == 18  # two keyless blocks served the first two
    clock.now += 30.0  # residency over: the next burst evicts it
    fill(pool, chain([2000, 2001, 2002, 2003, 2004, 2005], NS))
    assert pool.match(expensive) == []
    pool.check_integrity()


def test_everything_resident_raises_instead_of_waiting():
    clock = Clock()
    pool = BlockPool(3, min_residency_s=5.0, clock=clock)
    fill(pool, chain([1, 2, 3], NS))
    before = (list(pool.free_queue), dict(pool.index))
    with pytest.raises(PoolExhausted) as err:
        pool.allocate(1)
    assert err.value.available == 0 and err.value.num_resident == 3
    assert "minimum residency" in str(err.value)
    assert (list(pool.free_queue), dict(pool.index)) == before
    assert pool.num_evictable() == 0
    clock.now += 5.0
    assert pool.num_evictable() == 3
    assert len(pool.allocate(1).evicted) == 1
    pool.check_integrity()


def test_partial_residency_reports_what_is_evictable():
    clock = Clock()
    pool = BlockPool(4, min_residency_s=5.0, clock=clock)
    fill(pool, chain([1, 2], NS))
    with pytest.raises(PoolExhausted) as err:
        pool.allocate(3)
    assert (err.value.available, err.value.num_resident) == (2, 2)
    assert pool.allocate(2).evicted == []  # the two keyless blocks
    pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 3), st.floats(0, 4)), min_size=1, max_size=25))
def test_no_block_is_evicted_within_its_residency(steps):
    clock = Clock()
    pool = BlockPool(5, min_residency_s=6.0, clock=clock)
    committed_at = {}
    for first, length, dt in steps:
        clock.now += dt
        keys = chain([first + 10 * j for j in range(length)], NS)
        hit = pool.match(keys)
        pool.touch(hit)
        try:
            alloc = pool.allocate(len(keys) - len(hit))
        except PoolExhausted as err:
            resident = sum(1 for b in pool.free_queue if pool.resident_until[b] > clock.now)
            assert err.num_resident == resident
            pool.free(hit)
            pool.check_integrity()
            continue
        for key in alloc.evicted:
            assert committed_at.pop(key) + 6.0 <= clock.now, "evicted within its residency"
        for block_id, key in zip(alloc.block_ids, keys[len(hit):]):
            if pool.commit(block_id, key):
                committed_at[key] = clock.now
        pool.free(hit + alloc.block_ids)
        pool.check_integrity()
