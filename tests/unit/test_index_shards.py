"""Index shards without etcd: the key -> shard map, the index every shard's mirror shares against
one BlockIndex fed the same keys (the oracle), and a shard lost or resynced forgetting only its blocks.

    hypothesis draws keys, which nodes hold which (in which tier) and K; the shared index must answer as
    the oracle (longest_prefix, holders_of, lower_tiers), and with shard s forgotten as the oracle fed
    every other shard's keys: a prompt's prefix then ends at its first key of s, never later
    ShardedMirror over K mirrors fed by hand (snapshots, watch batches, etcd lost): each shard's
    snapshot and loss touch its blocks only; a key in the wrong shard is skipped as foreign
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta.block_table import fingerprints, key_words
from prefixpool.meta.etcd_client import EtcdClient, KeyValue, Snapshot, WatchBatch, WatchEvent
from prefixpool.meta.index import BlockIndex
from prefixpool.meta.layout import Layout
from prefixpool.meta.sharded_mirror import ShardedIndex, ShardedMirror
from prefixpool.meta.shards import parse_shards, shard_of, split
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.tier_names import DEVICE

NAMESPACE = Namespace("shards", block_size=4)
NODES = ["a", "b", "c"]
TIERS = [DEVICE, "host", "disk"]
LAYOUT = Layout("shards")


def test_parse_shards():
    assert parse_shards("a:1, b:2 ;c:3") == ("a:1,b:2", "c:3")
    assert parse_shards("a:1") == ("a:1",) and parse_shards("") == ()
    for bad in ("a", "http://a", "a:x;b:1"):
        try:
            parse_shards(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")


def test_keys_spread_over_every_shard_and_the_fingerprint_keeps_the_shard():
    keys = chain_ids(range(4000), NAMESPACE)
    for num_shards in (2, 3, 4):
        parts = split(keys, num_shards)
        assert sorted(map(len, parts))[0] > 4000 / num_shards * 0.85  # a hash: close to even
        assert all(shard_of(k, num_shards) == s for s, part in enumerate(parts) for k in part)
        assert (key_words(fingerprints(keys)) % num_shards).tolist() == [shard_of(k, num_shards) for k in keys]


holding = st.tuples(st.sampled_from(NODES), st.integers(0, 40), st.integers(0, 40), st.sampled_from(TIERS))


@settings(max_examples=150, deadline=None)
@given(num_shards=st.integers(2, 4), keys=st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=40,
       unique=True), holdings=st.lists(holding, max_size=6), down=st.integers(0, 3))  # fmt: skip
def test_the_shared_index_answers_as_one_index_and_forgets_one_shard_alone(num_shards, keys, holdings, down):
    down %= num_shards
    shared, oracle, others = ShardedIndex(num_shards), BlockIndex(), BlockIndex()
    for node, start, stop, tier in holdings:  # each holding: keys[start:stop] in one tier (gaps, moves)
        held = keys[min(start, stop) : stop]
        for index in (shared, oracle):
            index.add(node, held, tier)
        others.add(node, [k for k in held if shard_of(k, num_shards) != down], tier)
    assert_same(shared, oracle, keys)
    expected = oracle.longest_prefix(keys)
    shared.remove_shard(down)
    shared.check_integrity()
    assert_same(shared, others, keys)
    cut = next((i for i, key in enumerate(keys) if shard_of(key, num_shards) == down), len(keys))
    assert shared.longest_prefix(keys) == {node: min(n, cut) for node, n in expected.items() if min(n, cut)}


def assert_same(index: BlockIndex, oracle: BlockIndex, keys: list[bytes]) -> None:
    assert index.longest_prefix(keys) == oracle.longest_prefix(keys)
    assert [index.holders_of(k) for k in keys] == [oracle.holders_of(k) for k in keys]
    assert all(index.lower_tiers(node, keys) == oracle.lower_tiers(node, keys) for node in NODES)
    assert all(index.num_blocks(node) == oracle.num_blocks(node) for node in NODES)


def snapshot(revision: int, held: dict[str, list[bytes]]) -> Snapshot:
    kvs = [KeyValue(LAYOUT.block_key(key, node), DEVICE.encode(), revision, 0) for node, keys in held.items()
           for key in keys]  # fmt: skip
    return Snapshot(revision, kvs)


def test_a_shard_lost_or_resynced_forgets_only_its_blocks():
    keys = chain_ids(range(40), NAMESPACE)
    mirror = ShardedMirror([EtcdClient("127.0.0.1:1") for _ in range(2)], LAYOUT)  # fed by hand, never started
    part = split(keys, 2)
    for shard, m in enumerate(mirror.shards):
        m._load(snapshot(5, {"a": [k for k in part[shard] if k in keys[:30]], "b": part[shard][:3]}))
    oracle = BlockIndex()
    oracle.add("a", keys[:30])
    oracle.add("b", part[0][:3] + part[1][:3])
    assert mirror.longest_prefix(keys) == oracle.longest_prefix(keys) and mirror.num_keys() == 30

    mirror.shards[1]._lose()  # shard 1's etcd down: its blocks unknown, shard 0's stay
    cut = next(i for i, key in enumerate(keys) if shard_of(key, 2) == 1)
    expected = {node: min(n, cut) for node, n in oracle.longest_prefix(keys).items() if min(n, cut)}
    assert mirror.longest_prefix(keys) == expected
    assert mirror.num_keys() == len([k for k in keys[:30] if shard_of(k, 2) == 0])
    assert mirror.holders_of(part[0][0]) == {"a": DEVICE, "b": DEVICE} and mirror.holders_of(part[1][0]) == {}

    mirror.shards[1]._load(snapshot(9, {"c": part[1], "a": [part[0][-1]]}))  # resync; a shard-0 key misplaced
    assert mirror.home.num_skipped == 0 and mirror.shards[1].num_skipped == 1  # ... is skipped as foreign
    mirror.shards[0]._apply(WatchBatch(6, [WatchEvent(False, LAYOUT.block_key(part[0][0], "b"), b"", 6)]))
    truth = {k: {n: DEVICE for n, held in (("a", keys[:30]), ("b", part[0][1:3])) if k in held} for k in part[0]}
    truth |= {k: {"c": DEVICE} for k in part[1]}
    assert {k: mirror.holders_of(k) for k in keys} == truth
    mirror.index().check_integrity()


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
