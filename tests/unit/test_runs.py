"""Run-granular publication: boundaries from keys alone, matching against a brute-force oracle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta import runs
from prefixpool.meta.index import BlockIndex
from prefixpool.store.keys import Namespace, chain, chain_ids

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


# -- chain tails ----------------------------------------------------------------------------------

def publisher(run_blocks: int):
    """A Publisher never started: publish() only queues, _take() plays a write reaching etcd."""
    from prefixpool.meta.etcd_client import EtcdClient
    from prefixpool.meta.layout import Layout
    from prefixpool.meta.membership import Membership, NodeRecord
    from prefixpool.meta.publisher import Publisher, PublisherConfig

    record = NodeRecord("n0", "http://127.0.0.1:1", "tcp://127.0.0.1:1", 16, 1024, "tiny")
    membership = Membership(EtcdClient("127.0.0.1:1"), Layout("tails"), record)
    return Publisher(membership.client, membership, lambda: [], PublisherConfig(run_blocks=run_blocks))


def test_a_stored_chain_publishes_its_boundaries_and_its_tail_and_eviction_deletes_the_tail():
    keys = KEYS[:100]
    ends = runs.boundaries(keys, 8)
    assert ends[-1] != 99
    node = publisher(8)
    node.publish(stored=keys[:60])  # a first request: tail at 59
    node.publish(stored=keys[60:])  # its next turn: tail at 99
    expected = {keys[i] for i in ends} | {keys[59], keys[99]}
    assert set(node._pending) == expected and set(node._take()) == expected  # written
    node.publish(stored=keys[50:70], tier="host")  # moved: tail 59 goes along, non-tails stay unpublished
    assert set(node._pending) == {keys[i] for i in ends if 50 <= i < 70} | {keys[59], keys[69]}
    node._take()
    node.publish(removed=keys[40:])  # evicted: each published key is deleted, never one it did not publish
    assert node._pending == dict.fromkeys([keys[i] for i in ends if i >= 40] + [keys[59], keys[69], keys[99]])
    node._take()
    node.publish(stored=keys[40:45])  # back: a new tail, the old tails stay forgotten
    assert set(node._pending) == {keys[i] for i in ends if 40 <= i < 45} | {keys[44]}


def test_a_tail_stored_then_evicted_before_any_write_is_nothing():
    keys = KEYS[:30]
    node = publisher(8)
    node.publish(stored=keys)
    node.publish(removed=keys)
    assert node.num_pending == 0 and node.num_coalesced == len(runs.boundaries(keys, 8)) + 1


def test_the_router_match_reaches_a_held_tail_but_never_past_a_missing_boundary():
    keys = KEYS[:200]
    ends = runs.boundaries(keys, 8)
    assert ends[3] - 1 > ends[2] and ends[1] - 2 > ends[0]
    index = BlockIndex()
    index.add("n0", runs.published(keys[:ends[3] + 5], 8, [keys[ends[3] + 4]]))  # tail 4 past boundary 3
    index.add("n1", runs.published(keys[:ends[1] - 1], 8, [keys[ends[1] - 2]]))  # tail just before boundary 1
    index.add("n2", [keys[ends[0]], keys[ends[3] - 1]])  # boundary 0, not 1: its key before 3 is unreachable
    index.add("n3", [keys[ends[0] - 1]])  # only a tail inside the first run
    assert runs.longest_prefix(index, keys, 8) == {
        "n0": ends[3] + 5, "n1": ends[1] - 1, "n2": ends[0] + 1, "n3": ends[0]}
    assert runs.longest_prefix(index, keys[:ends[3] + 2], 8)["n0"] == ends[3] + 1  # the prompt ends first


@settings(max_examples=80, deadline=None)
@given(n=st.sampled_from([2, 4, 8, 16]), fork=st.integers(1, 150),
       stores=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(1, 200)), min_size=1, max_size=8),
       prompt=st.tuples(st.booleans(), st.integers(1, 200)))
def test_tails_never_match_more_than_per_block_and_as_much_at_a_stored_chain_end(n, fork, stores, prompt):
    """Chains from two sequences sharing `fork` blocks, stored on random nodes (per block: every key in the
    index; runs: what the node publishes). A prompt matches no more than per block, and as much whenever the
    per-block match ends where a chain its node stored ends."""
    seqs = [KEYS[:200], KEYS[:fork] + KEYS[1000 : 1200 - fork]]
    per_block, by_runs, ends_at = BlockIndex(), BlockIndex(), {}
    for node, which, cut in stores:
        chain = seqs[which][:cut]
        per_block.add(f"n{node}", chain)
        by_runs.add(f"n{node}", runs.published(chain, n, chain[-1:]))
        ends_at.setdefault(f"n{node}", set()).add(chain[-1])
    keys = seqs[prompt[0]][: prompt[1]]
    exact, matched = per_block.longest_prefix(keys), runs.longest_prefix(by_runs, keys, n)
    for node, num in matched.items():
        assert num <= exact[node]
    for node, num in exact.items():
        if keys[num - 1] in ends_at[node]:
            assert matched.get(node) == num


def engine_for_tails(chunk_size=512):
    from prefixpool.engine.checkpoint import random_model
    from prefixpool.model.config import preset
    from tests.support.engine import make_engine

    return make_engine(random_model(preset("tiny"), seed=2), chunk_size=chunk_size)


def test_one_engine_step_storing_two_requests_chains_publishes_both_tails():
    """The worker publishes a whole step's pool events at once: each request ending in it keeps its own tail."""
    from prefixpool.engine.sampling import SamplingParams
    from prefixpool.node.exchange import BlockExchange
    from tests.support.engine import tokens

    engine = engine_for_tails()
    prompts = [tokens(20, 1), tokens(27, 2)]  # 5 and 6 full blocks of 4 tokens
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_tokens=1))
    engine.step()  # both prompts prefill in this one step, and both requests finish in it
    assert not engine.has_work()
    stored, evicted, tails = engine.take_pool_events()
    chains = [chain(prompt, engine.namespace) for prompt in prompts]
    assert stored == [*chains[0], *chains[1]] and tails == [chains[0][-1], chains[1][-1]]
    node = publisher(64)
    BlockExchange(engine.blocks, engine.arena, node, fetcher=None).publish([*stored, *evicted], tails)
    boundaries = {key for key in stored if runs.is_boundary(key, 64)}
    assert not boundaries & set(tails) and set(node._pending) == boundaries | set(tails)


def test_a_prefill_over_several_steps_publishes_no_tail_until_its_request_ends_then_one():
    """Intermediate prefill chunks name no tail; the request's end names its last key stored, stored steps ago."""
    from prefixpool.engine.sampling import SamplingParams
    from prefixpool.node.exchange import BlockExchange
    from tests.support.engine import tokens

    engine = engine_for_tails(chunk_size=8)
    prompt = tokens(42, 3)  # 10 full blocks of 4, prefilled 8 tokens a step
    engine.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # a decode fills no block
    stored, steps = [], 0
    while engine.has_work():
        engine.step()
        steps += 1
        events = engine.take_pool_events()
        if engine.has_work():
            assert events.tails == [] and events.evicted == []
            stored += events.stored
    assert steps > 5 and stored == chain(prompt, engine.namespace)  # the last step stores no full block
    assert events.tails == [stored[-1]] and events.stored == [stored[-1]]  # re-stated with its tail
    node = publisher(64)
    BlockExchange(engine.blocks, engine.arena, node, fetcher=None).publish(events.stored, events.tails)
    assert list(node._pending) == [stored[-1]]


def test_a_long_decode_publishes_no_tail_per_generated_block_only_its_last_at_the_end():
    from prefixpool.engine.sampling import SamplingParams
    from tests.support.engine import tokens

    engine = engine_for_tails()
    prompt = tokens(10, 4)
    engine.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True))  # about 10 generated blocks fill
    stored, tails = [], []
    while engine.has_work():
        engine.step()
        events = engine.take_pool_events()
        stored += events.stored
        tails.append(events.tails)
    assert len(set(stored)) == (10 + 30 - 1) // 4 and not any(tails[:-1])  # 2 prompt + 7 generated blocks
    assert tails[-1] == [stored[-1]] and stored[-1] == stored[-2]  # the last block stored, re-stated at the end


def test_an_abort_ends_a_chain_like_a_finish():
    from prefixpool.engine.sampling import SamplingParams
    from tests.support.engine import tokens

    engine = engine_for_tails(chunk_size=8)
    prompt = tokens(20, 5)
    request_id = engine.submit(prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    engine.step()
    engine.step()  # 16 of 20 prompt tokens: 4 blocks stored
    assert engine.take_pool_events().tails == []
    assert engine.abort(request_id)
    last = chain(prompt, engine.namespace)[3]
    assert engine.take_pool_events() == ([last], [], [last])
