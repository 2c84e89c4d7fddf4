"""Index shards without etcd: the key -> shard map, and longest_prefix over K shard indexes against
one unsharded index (the oracle), with any shard down.

    hypothesis draws chains, which nodes hold how deep, and K; the shards' answer must equal the
    oracle's with every shard up, and with shard s down must equal the oracle's cut at the first
    key of s: a shard down only ever shortens a prefix, never lengthens one
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta.index import BlockIndex
from prefixpool.meta.sharded_mirror import ShardedIndex, longest_prefix, shard_positions
from prefixpool.meta.shards import parse_shards, shard_of, split
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.tier_names import DEVICE

NAMESPACE = Namespace("shards", block_size=4)
NODES = ["a", "b", "c"]


def test_parse_shards():
    assert parse_shards("a:1, b:2 ;c:3") == ("a:1,b:2", "c:3")
    assert parse_shards("a:1") == ("a:1",) and parse_shards("") == ()
    for bad in ("a", "http://a", "a:x;b:1"):
        try:
            parse_shards(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")


def test_keys_spread_over_every_shard_and_split_agrees_with_shard_of():
    keys = chain_ids(range(4000), NAMESPACE)
    for num_shards in (2, 3, 4):
        parts = split(keys, num_shards)
        assert sorted(map(len, parts))[0] > 4000 / num_shards * 0.85  # a hash: close to even
        assert all(shard_of(k, num_shards) == s for s, part in enumerate(parts) for k in part)
        positions = shard_positions(keys, num_shards)
        assert [[keys[i] for i in at] for at in positions] == parts


@settings(max_examples=150, deadline=None)
@given(num_shards=st.integers(2, 4), length=st.integers(1, 40),
       depths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=3, max_size=3),
       seed=st.integers(0, 1000))  # fmt: skip
def test_sharded_longest_prefix_is_the_unsharded_one(num_shards, length, depths, seed):
    keys = chain_ids(range(seed, seed + length), NAMESPACE)
    oracle, shards = BlockIndex(), [BlockIndex() for _ in range(num_shards)]
    for node, (start, stop) in zip(NODES, depths):  # each node holds keys[start:stop] (a gap before start)
        held = keys[min(start, stop) : stop]
        oracle.add(node, held, DEVICE)
        for shard, part in enumerate(split(held, num_shards)):
            shards[shard].add(node, part, DEVICE)
    expected = oracle.longest_prefix(keys)
    assert longest_prefix(shards, keys) == expected
    assert ShardedIndex(shards).longest_prefix(keys) == expected
    for down in range(num_shards):
        cut = next((i for i, key in enumerate(keys) if shard_of(key, num_shards) == down), length)
        indexes = [None if s == down else index for s, index in enumerate(shards)]
        answer = longest_prefix(indexes, keys)
        assert answer == {node: min(n, cut) for node, n in expected.items() if min(n, cut)}, (down, cut)


def test_lower_tiers_and_tier_of_over_shards():
    keys = chain_ids(range(30), NAMESPACE)
    shards = [BlockIndex() for _ in range(2)]
    for shard, part in enumerate(split(keys[:10], 2)):
        shards[shard].add("a", part, "disk")
    for shard, part in enumerate(split(keys[10:20], 2)):
        shards[shard].add("a", part, "host")
    index = ShardedIndex(shards)
    assert index.lower_tiers("a", keys) == {"disk": 10, "host": 10}
    assert index.tier_of("a", keys[3]) == "disk" and index.tier_of("a", keys[25]) is None
    down = shard_of(keys[0], 2)
    partial = ShardedIndex([None if s == down else shards[s] for s in range(2)])
    assert partial.tier_of("a", keys[0]) is None
    assert sum(partial.lower_tiers("a", keys).values()) == sum(1 for k in keys[:20] if shard_of(k, 2) != down)


def test_every_process_reads_the_shards_alike():
    """Router, worker and sidecar settings (--etcd-shards) and the connector's etcd_shards: shard 0 is
    --etcd-endpoints (its default gives way; another value is refused), one shard when unset."""
    from prefixpool.deploy.router_settings import RouterSettings
    from prefixpool.deploy.worker_settings import WorkerSettings
    from prefixpool.vllm_connector.config import BadConnectorConfig, config_from

    assert RouterSettings().shard_endpoints == ("127.0.0.1:2379",)
    sharded = WorkerSettings(etcd_shards="a:1,a:2;b:1")
    assert sharded.etcd_endpoints == "a:1,a:2" and sharded.shard_endpoints == ("a:1,a:2", "b:1")
    same = RouterSettings(etcd_endpoints="a:1,a:2", etcd_shards="a:1,a:2;b:1")
    assert same.shard_endpoints == sharded.shard_endpoints
    for bad in ({"etcd_endpoints": "c:1", "etcd_shards": "a:1;b:1"}, {"etcd_shards": "a;b:1"}):
        try:
            RouterSettings(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
    assert config_from({"etcd_shards": "a:1;b:1"}).shard_endpoints() == ("a:1", "b:1")
    assert config_from({}).shard_endpoints() == ("127.0.0.1:2379",)
    try:
        config_from({"etcd_shards": "a;b"})
    except BadConnectorConfig:
        return
    raise AssertionError("a bad etcd_shards accepted")
