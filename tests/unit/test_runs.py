"""Run-granular publication: boundaries from keys alone, matching against a brute-force oracle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta import runs
from prefixpool.meta.index import BlockIndex
from prefixpool.store.keys import Namespace, chain_ids

KEYS = chain_ids(range(4096), Namespace("runs"))


@pytest.mark.parametrize("bad", [0, 3, 12, 512, -4])
def test_run_blocks_must_be_a_power_of_two_up_to_256(bad):
    with pytest.raises(ValueError):
        runs.check_run_blocks(bad)


@pytest.mark.parametrize("n", [2, 4, 16, 32, 64])
def test_about_one_key_in_n_is_a_boundary_and_larger_n_nest(n):
    ends = runs.boundaries(KEYS, n)
    assert 0.6 < len(ends) * n / len(KEYS) < 1.4
    assert set(runs.boundaries(KEYS, 2 * n)) <= set(ends)  # a router set coarser than its nodes still matches
    assert runs.published(KEYS, n) == [KEYS[i] for i in ends]
    assert runs.boundaries(KEYS, 1) == list(range(len(KEYS)))


def brute(held: dict[str, set], keys, n) -> dict[str, int]:
    """Per node: through the last boundary such that it holds every boundary up to it."""
    answer = {}
    for node, blocks in held.items():
        matched = 0
        for i, key in enumerate(keys):
            if runs.is_boundary(key, n):
                if key not in blocks:
                    break
                matched = i + 1
        if matched:
            answer[node] = matched
    return answer


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([1, 2, 4, 8]), cuts=st.lists(st.integers(0, 120), min_size=1, max_size=4),
       holes=st.lists(st.integers(0, 119), max_size=3))
def test_longest_prefix_at_run_granularity_equals_brute_force(n, cuts, holes):
    keys = KEYS[:120]
    held = {f"n{i}": set(keys[:cut]) - {keys[h] for h in holes if i == 0} for i, cut in enumerate(cuts)}
    index = BlockIndex()
    for node, blocks in held.items():
        index.add(node, runs.published([k for k in keys if k in blocks], n))
    assert runs.longest_prefix(index, keys, n) == brute(held, keys, n)


def test_run_lengths_cover_the_keys_up_to_the_last_boundary():
    lengths = runs.run_lengths(KEYS[:300], 8)
    ends = runs.boundaries(KEYS[:300], 8)
    assert sum(lengths.values()) == ends[-1] + 1
    assert list(lengths) == [KEYS[i] for i in ends]


def test_mirror_counts_a_run_in_its_boundary_tier():
    from prefixpool.meta.etcd_client import EtcdClient
    from prefixpool.meta.layout import Layout
    from prefixpool.meta.mirror import Mirror, MirrorConfig

    mirror = Mirror(EtcdClient("127.0.0.1:1"), Layout("tiers"), MirrorConfig(run_blocks=4))
    keys = KEYS[:200]
    ends = runs.boundaries(keys, 4)
    mirror.index.add("n0", [keys[ends[0]], keys[ends[2]]], "device")
    mirror.index.add("n0", [keys[ends[1]]], "host")
    assert mirror.longest_prefix(keys) == {"n0": ends[2] + 1}
    assert mirror.lower_tiers("n0", keys[: ends[2] + 1]) == {"host": ends[1] - ends[0]}
    assert mirror.lower_tiers("n1", keys) == {}
