"""The block pool: a hand-written state machine, then hypothesis against an oracle."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixpool.store.keys import Namespace, chain
from prefixpool.store.pool import BlockPool, PoolExhausted

NS = Namespace("test", block_size=2)


def keys_for(*tokens):
    return chain(list(tokens), NS)


def fill(pool, keys):
    """Allocate, commit and free one request's blocks; return nothing held."""
    alloc = pool.allocate(len(keys))
    for block_id, key in zip(alloc.block_ids, keys):
        pool.commit(block_id, key)
    pool.free(alloc.block_ids)
    pool.check_integrity()
    return alloc


def test_freed_blocks_stay_hittable_until_reallocated():
    pool = BlockPool(4)
    keys = keys_for(1, 2, 3, 4, 5, 6)
    fill(pool, keys)
    assert len(pool.match(keys)) == 3
    alloc = pool.allocate(2)  # one keyless block first, then the LRU cached block
    pool.check_integrity()
    assert len(alloc.evicted) == 1
    pool.free(alloc.block_ids)
    pool.check_integrity()


def test_tail_first_eviction_keeps_heads():
    pool = BlockPool(3)
    keys = keys_for(1, 2, 3, 4, 5, 6)
    fill(pool, keys)
    alloc = pool.allocate(1)
    assert alloc.evicted == [keys[2]]
    assert len(pool.match(keys)) == 2
    pool.free(alloc.block_ids)
    alloc = pool.allocate(2)
    assert set(alloc.evicted) == {keys[1]}  # the keyless block went first, then the next tail
    assert len(pool.match(keys)) == 1
    pool.check_integrity()


def test_match_stops_at_first_miss():
    pool = BlockPool(8)
    keys = keys_for(*range(8))
    fill(pool, [keys[0], keys[2]])
    assert pool.match(keys) == [pool.lookup(keys[0])]


def test_touch_pins_and_pinned_blocks_are_never_evicted():
    pool = BlockPool(2)
    keys = keys_for(1, 2, 3, 4)
    fill(pool, keys)
    pinned = pool.match(keys)
    pool.touch(pinned)
    pool.check_integrity()
    with pytest.raises(PoolExhausted) as err:
        pool.allocate(1)
    assert err.value.requested == 1 and err.value.available == 0
    assert pool.match(keys) == pinned  # nothing changed
    pool.free(pinned)
    pool.check_integrity()
    assert pool.allocate(2).evicted == [keys[1], keys[0]]


def test_exhausted_allocation_changes_nothing():
    pool = BlockPool(3)
    fill(pool, keys_for(1, 2))
    before = (list(pool.free_queue), dict(pool.index))
    with pytest.raises(PoolExhausted):
        pool.allocate(4)
    assert (list(pool.free_queue), dict(pool.index)) == before


def test_duplicate_commit_keeps_one_live_block():
    pool = BlockPool(4)
    (key,) = keys_for(7, 7)
    a = pool.allocate(2)
    assert pool.commit(a.block_ids[0], key) is True
    assert pool.commit(a.block_ids[1], key) is False
    assert pool.lookup(key) == a.block_ids[0]
    pool.free(a.block_ids)
    pool.check_integrity()
    assert pool.num_cached == 1


def test_drop_forgets_an_unpinned_key():
    pool = BlockPool(2)
    (key,) = keys_for(1, 1)
    fill(pool, [key])
    assert pool.drop(key) is True
    assert pool.lookup(key) is None
    pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / commit / match / touch / free against a brute-force model."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(6)
        self.held: list[list[int]] = []  # pinned block lists, one per open request
        self.pins = [0] * 6  # oracle ref counts

    @rule(seq=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def request(self, seq):
        keys = keys_for(*[t for x in seq for t in (x, x)])
        hit = self.pool.match(keys)
        # oracle: brute-force longest prefix over the index
        n = 0
        while n < len(keys) and keys[n] in self.pool.index:
            n += 1
        assert len(hit) == n
        self.pool.touch(hit)
        for b in hit:
            self.pins[b] += 1
        need = len(keys) - len(hit)
        pinned_before = {b for b in range(6) if self.pins[b] > 0}
        try:
            alloc = self.pool.allocate(need)
        except PoolExhausted:
            assert need > 6 - len(pinned_before)
            self.pool.free(hit)
            for b in hit:
                self.pins[b] -= 1
            return
        assert not set(alloc.block_ids) & pinned_before, "a pinned block was reallocated"
        for b in alloc.block_ids:
            self.pins[b] += 1
        for b, key in zip(alloc.block_ids, keys[len(hit):]):
            self.pool.commit(b, key)
        self.held.append(hit + alloc.block_ids)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10))
    def finish(self, i):
        blocks = self.held.pop(i % len(self.held))
        self.pool.free(blocks)
        for b in blocks:
            self.pins[b] -= 1

    @invariant()
    def consistent(self):
        self.pool.check_integrity()
        assert self.pool.ref_count == self.pins
        assert all(c >= 0 for c in self.pool.ref_count)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase
