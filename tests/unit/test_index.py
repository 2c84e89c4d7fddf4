"""The compact block index against a dict-of-dicts model, a forced fingerprint collision, growth, many nodes."""

import asyncio
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta.block_table import FOLD, MIN_BUCKETS, BlockTable, fingerprints
from prefixpool.meta.index import BlockIndex
from prefixpool.store.arena import ArenaShape, KVArena
from prefixpool.store.keys import Namespace, chain_ids
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.transfer import Fetcher, serve
from tests.support.blocks import commit_random

KEYS = chain_ids(range(300), Namespace("index-test"))  # past one table's first rebuild (96 used slots)
NODES = ["a", "b", "c", "d", "e"]
TIERS = ["device", "device", "host", "disk"]
M64 = (1 << 64) - 1


class Model:
    """The reference: {node: {key: tier}}, answered the obvious way."""

    def __init__(self) -> None:
        self.held: dict[str, dict[bytes, str]] = {}

    def add(self, node, keys, tier="device"):
        self.held.setdefault(node, {}).update((key, tier) for key in keys)

    def remove(self, node, keys):
        for key in keys:
            self.held.get(node, {}).pop(key, None)

    def remove_node(self, node):
        self.held.pop(node, None)

    def longest_prefix(self, keys):
        matches = {}
        for node, held in self.held.items():
            num = 0
            while num < len(keys) and keys[num] in held:
                num += 1
            if num:
                matches[node] = num
        return matches

    def lower_tiers(self, node, keys):
        counts = {}
        for key in keys:
            tier = self.held.get(node, {}).get(key)
            if tier not in (None, "device"):
                counts[tier] = counts.get(tier, 0) + 1
        return counts


key_ids = st.lists(st.integers(0, len(KEYS) - 1), max_size=100)  # > FEW: the vectorised rounds too
ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "remove_node"]), st.sampled_from(NODES), key_ids,
                         st.sampled_from(TIERS)), max_size=30)
queries = st.lists(st.tuples(st.integers(0, len(KEYS) - 1), st.integers(0, 60)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(ops, queries, st.sampled_from([64, 2]))
def test_the_index_answers_as_the_model_does(operations, runs, group_nodes):
    index, model = BlockIndex(group_nodes), Model()
    for op, node, ids, tier in operations:
        keys = [KEYS[i] for i in ids]
        if op == "add":
            index.add(node, keys, tier)
            model.add(node, keys, tier)
        elif op == "remove":
            index.remove(node, keys)
            model.remove(node, keys)
        else:
            index.remove_node(node)
            model.remove_node(node)
        index.check_integrity()
    for start, length in runs:  # chains from anywhere, running past what anyone holds
        keys = KEYS[start : start + length]
        assert index.longest_prefix(keys) == model.longest_prefix(keys)
        for node in NODES:
            assert index.lower_tiers(node, keys) == model.lower_tiers(node, keys)
    for node in NODES:
        held = model.held.get(node, {})
        assert [index.tier_of(node, key) for key in KEYS] == [held.get(key) for key in KEYS]
        assert index.num_blocks(node) == len(held)
        assert index.num_lower(node) == sum(tier != "device" for tier in held.values())
    groups: dict[int, set] = {}  # len counts a block once per group of nodes holding it
    for node, held in model.held.items():
        if held:  # a node holding nothing has no slot
            groups.setdefault(index.slot_of[node][0], set()).update(held)
    assert len(index) == sum(map(len, groups.values()))


def test_tiers_move_and_only_lower_ones_are_counted():
    index = BlockIndex()
    index.add("a", KEYS[:4], tier="host")
    index.add("a", KEYS[2:6])
    assert [index.tier_of("a", key) for key in KEYS[:7]] == ["host"] * 2 + ["device"] * 4 + [None]
    assert index.tier_of("b", KEYS[0]) is None
    assert index.lower_tiers("a", KEYS[:6]) == {"host": 2} and index.num_lower("a") == 2
    assert index.holders_of(KEYS[0]) == {"a": "host"}
    index.check_integrity()


def colliding(key: bytes) -> bytes:
    """Another 16-byte key with `key`'s fingerprint: bytes 12..16 changed (8..12 the fingerprint keeps whole),
    the low half compensating: low * FOLD ^ high stays the same."""
    low, high = struct.unpack("<QQ", key)
    other_high = (high + (1 << 32)) & M64
    fold = int(FOLD)
    other_low = ((low * fold & M64) ^ high ^ other_high) * pow(fold, -1, 1 << 64) & M64
    return struct.pack("<QQ", other_low, other_high)


def test_a_fingerprint_collision_costs_a_miss_never_a_wrong_block():
    """Two keys sharing a fingerprint are one entry, so the index says the holder of one holds the other
    too; the holder's pool and the transfer match full keys, so asking for the other moves nothing."""
    held, other = KEYS[0], colliding(KEYS[0])
    assert other != held and (fingerprints([other]) == fingerprints([held])).all()
    index = BlockIndex()
    index.add("peer", [held])
    assert index.longest_prefix([other]) == {"peer": 1}  # the false "held": the router may send work there
    index.check_integrity()

    async def fetch_other():
        shape = ArenaShape(4, 2, 4, 2, 8)
        peer, peer_arena = NodeBlocks(BlockPool(4)), KVArena(shape)
        commit_random(peer, peer_arena, [held])
        assert peer.acquire([other]).block_ids == []  # the peer's own match: the full key
        receiver, receiver_arena, fetcher = NodeBlocks(BlockPool(4)), KVArena(shape), Fetcher()
        server = await serve(peer, peer_arena, "tcp://127.0.0.1:0")
        try:
            result = await fetcher.fetch(server.url, [other], receiver, receiver_arena, deadline_s=30.0)
            receiver.release(result.hold)
            return result, receiver
        finally:
            await fetcher.close()
            await server.close()

    result, receiver = asyncio.run(fetch_other())
    assert result.keys == [] and receiver.acquire([other]).block_ids == []  # a miss: the receiver recomputes


def test_growth_and_churn_keep_every_answer_and_the_load_bounded():
    keys = [bytes(row) for row in np.random.default_rng(5).integers(0, 256, (40_000, 16), dtype=np.uint8)]
    index = BlockIndex()
    for i in range(0, 30_000, 1000):
        index.add(f"n{i // 1000 % 3}", keys[i : i + 1000])
    table = index.groups[0]
    assert table.capacity > MIN_BUCKETS * 8 and len(index) == 30_000
    index.check_integrity()
    for i in range(0, 30_000, 2000):  # evict half, store 10,000 new: tombstones, then a rebuild
        index.remove(f"n{i // 1000 % 3}", keys[i : i + 1000])
    index.add("n0", keys[30_000:])
    index.check_integrity()
    assert len(index) == 25_000 and table.num_used <= 0.75 * table.capacity
    assert index.longest_prefix(keys[1000:2001]) == {"n1": 1000}
    assert index.longest_prefix(keys[30_000:]) == {"n0": 10_000}
    assert index.longest_prefix(keys[:5]) == {}


def test_many_nodes_take_several_groups_and_free_bits_are_reused():
    index = BlockIndex()
    for n in range(130):
        index.add(f"n{n}", KEYS[: 1 + n % 50])
    assert len(index.groups) == 3 and len(index) == 50 + 50 + 30  # once per group: n128, n129 hold 29, 30
    expected = {f"n{n}": 1 + n % 50 for n in range(130)}
    assert index.longest_prefix(KEYS[:60]) == expected
    index.remove_node("n3")
    index.remove("n70", KEYS[: 1 + 70 % 50])
    index.check_integrity()
    assert "n3" not in index.longest_prefix(KEYS[:60]) and "n70" not in index.slot_of
    index.add("late", KEYS[:2])
    assert index.slot_of["late"] == (0, 3) and len(index.groups) == 3  # n3's bit, not a fourth group
    index.check_integrity()


def test_a_table_finds_what_it_placed_in_full_buckets():
    """40 fingerprints whose home is the last bucket: chains of full buckets wrapping round to the first."""
    table = BlockTable(16)
    pool = np.unique(np.random.default_rng(1).integers(1, 2**63, 20_000).astype(np.uint64))
    homes = table._home(pool)
    fps = np.concatenate([pool[homes == 15][:40], pool[homes != 15][:40]])
    slots = table.insert(fps)
    assert (table.fill == 8).sum() >= 5 and (table.find(fps) == slots).all()
    assert all(table.find(fps[i : i + 1])[0] == slots[i] for i in range(fps.size))  # the Python walk alone
    assert (table.find(np.setdiff1d(pool, fps)[:100]) == -1).all()
    table.check_integrity()
