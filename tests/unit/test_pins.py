"""Pins in the block pool and the pinned-prefix registry, on a hand-set clock."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.store.keys import Namespace, chain
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pins import PrefixPins
from prefixpool.store.pool import BlockPool, PoolExhausted

NS = Namespace("pins", block_size=1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fill(pool, keys):
    hit = pool.match(keys)
    pool.touch(hit)
    alloc = pool.allocate(len(keys) - len(hit))
    for block_id, key in zip(alloc.block_ids, keys[len(hit):]):
        pool.commit(block_id, key)
    pool.free(hit + alloc.block_ids)
    pool.check_integrity()
    return hit


def storm(pool, num_requests, start=10_000):
    """Distinct prefixes, each as long as the pool allows."""
    for i in range(num_requests):
        try:
            fill(pool, chain([start + i, start + i + 1], NS))
        except PoolExhausted:
            pass
        pool.check_integrity()


def test_pinned_blocks_survive_an_eviction_storm():
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    hot = chain([1, 2, 3], NS)
    fill(pool, hot)
    assert pool.pin(hot, ttl_s=60.0) == hot
    pool.check_integrity()
    storm(pool, 50)
    assert len(pool.match(hot)) == 3
    assert pool.num_free == 3  # the pins hold their blocks out of the free queue


def test_a_pins_ttl_expires_lazily_and_the_block_becomes_evictable():
    clock = Clock()
    pool = BlockPool(4, clock=clock)
    hot = chain([1, 2], NS)
    fill(pool, hot)
    pool.pin(hot, ttl_s=10.0)
    clock.now = 9.9
    storm(pool, 10)
    assert len(pool.match(hot)) == 2
    clock.now = 10.0
    assert set(pool.expire_pins()) == set(hot)
    pool.check_integrity()
    storm(pool, 10, start=20_000)
    assert pool.match(hot) == []


def test_pin_before_commit_applies_at_commit_and_unpin_releases():
    clock = Clock()
    pool = BlockPool(3, clock=clock)
    key = chain([9], NS)
    assert pool.pin(key, ttl_s=5.0) == []
    pool.check_integrity()
    fill(pool, key)
    assert pool.ref_count[pool.lookup(key[0])] == 1  # held by the pin
    storm(pool, 5)
    assert pool.match(key) != []
    pool.unpin(key)
    pool.check_integrity()
    assert pool.ref_count[pool.lookup(key[0])] == 0


def test_repinning_extends_and_never_shortens():
    clock = Clock()
    pool = BlockPool(2, clock=clock)
    key = chain([4], NS)
    fill(pool, key)
    pool.pin(key, 10.0)
    pool.pin(key, 2.0)
    clock.now = 5.0
    assert pool.expire_pins() == []
    assert pool.ref_count[pool.lookup(key[0])] == 1
    clock.now = 10.0
    assert pool.expire_pins() == key
    pool.check_integrity()


def test_named_pins_share_keys_and_the_longest_wins():
    clock = Clock()
    pool = BlockPool(8, clock=clock)
    pins = NodeBlocks(pool)
    system = chain([1, 2, 3], NS)
    fill(pool, system)
    pins.pin("a", system, ttl_s=100.0)
    pins.pin("b", system[:2], ttl_s=10.0)
    pins.unpin("a")
    pins.check_integrity()
    assert set(pool.pins) == set(system[:2])  # "b" still wants the head
    assert all(pool.pins[k].expires_at == 10.0 for k in system[:2])  # shortened to b's deadline
    clock.now = 10.0
    assert pins.live_names() == {}
    pool.expire_pins()
    assert pool.pins == {}
    pool.check_integrity()


def test_soft_pins_protect_the_most_hit_prefix_up_to_the_budget():
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    pins = NodeBlocks(pool, pins=PrefixPins(soft_budget_blocks=2, soft_ttl_s=30.0))
    hot = chain([1, 2, 3], NS)
    warm = chain([7, 8], NS)
    fill(pool, hot)
    fill(pool, warm)
    for _ in range(5):
        pins.pins.record_hits(hot[: len(fill(pool, hot))])
    pins.pins.record_hits(warm[: len(pool.match(warm))])
    change = pins.refresh_soft()
    assert change.pinned == sorted(hot[:2]) and change.unpinned == []
    pool.check_integrity()
    storm(pool, 30)
    assert len(pool.match(hot)) == 2  # the head, within the budget, survived; the tail did not
    assert pool.match(warm) == []
    for _ in range(9):
        pins.pins.record_hits(chain([50, 51], NS))
    change = pins.refresh_soft()
    assert change.unpinned == sorted(hot[:2])
    assert set(pool.pins) == set(chain([50, 51], NS))  # pending: not cached
    clock.now = 31.0
    pool.expire_pins()
    assert pool.pins == {}
    pool.check_integrity()


def test_hit_counts_age_when_the_table_is_full():
    pins = PrefixPins(soft_budget_blocks=1, max_tracked=4)
    hot = chain([1], NS)
    for _ in range(10):
        pins.record_hits(hot)
    for i in range(10):
        pins.record_hits(chain([100 + i], NS))
    assert len(pins.hits) <= 4
    assert hot[0] in pins.hits and pins.hits[hot[0]] >= 1


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pin", "unpin", "req", "tick", "soft"]), st.integers(0, 5)),
                    max_size=30))
def test_pins_and_requests_keep_the_pool_consistent(ops):
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    pins = NodeBlocks(pool, pins=PrefixPins(soft_budget_blocks=2, soft_ttl_s=7.0))
    for op, x in ops:
        keys = chain([x, x + 1, x + 2][: 1 + x % 3], NS)
        if op == "pin":
            pins.pin(f"p{x % 2}", keys, ttl_s=1.0 + x)
        elif op == "unpin":
            pins.unpin(f"p{x % 2}")
        elif op == "req":
            try:
                pins.pins.record_hits(keys[: len(fill(pool, keys))])
            except PoolExhausted:
                pass
        elif op == "tick":
            clock.now += x
            pool.expire_pins()
        else:
            pins.refresh_soft()
        pool.check_integrity()
        wanted = {k for pin in pins.live_names().values() for k in pin.keys}
        assert all(k in pool.pins for k in wanted), "a live named pin lost its pool pin"
