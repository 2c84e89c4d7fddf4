"""The block index against a brute-force longest prefix."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta.index import BlockIndex
from prefixpool.store.keys import Namespace, chain_ids

KEYS = chain_ids(range(8), Namespace("index-test"))
NODES = ["a", "b", "c"]

ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "remove_node"]), st.sampled_from(NODES),
              st.lists(st.integers(0, 7), max_size=5)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_longest_prefix_matches_brute_force(operations, query):
    index, truth = BlockIndex(), {n: set() for n in NODES}
    for op, node, ids in operations:
        keys = [KEYS[i] for i in ids]
        if op == "add":
            index.add(node, keys)
            truth[node] |= set(keys)
        elif op == "remove":
            index.remove(node, keys)
            truth[node] -= set(keys)
        else:
            index.remove_node(node)
            truth[node] = set()
        index.check_integrity()
    keys = [KEYS[i] for i in query]
    expected = {}
    for node, held in truth.items():
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        if n:
            expected[node] = n
    assert index.longest_prefix(keys) == expected
    assert len(index) == len(set().union(*truth.values()))


def test_tiers_are_recorded():
    index = BlockIndex()
    index.add("a", KEYS[:2], tier="host")
    assert index.tier_of("a", KEYS[0]) == "host"
    assert index.tier_of("b", KEYS[0]) is None
