"""Routing policies on hand-built matches and loads."""

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixpool.router.cost_model import CostModel, profile
from prefixpool.router.policy import NodeLoad, RouteRequest, policies

COSTS = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=1000.0, link_bytes_per_s=1e9)
IDLE = {"a": NodeLoad(), "b": NodeLoad(), "c": NodeLoad()}
REQ = RouteRequest(num_prompt_tokens=1600, num_blocks=100)


def choose(name, matches, loads, request=REQ, costs=COSTS):
    return policies()[name](request, matches, loads, costs, random.Random(0), explain=True)


def test_cost_prefers_the_holder_when_idle():
    plan = choose("cost", {"b": 90}, IDLE)
    assert plan.worker == "b" and plan.fetch_from is None and plan.local_blocks == 90
    assert plan.prefill_tokens == 1600 - 90 * 16


def test_cost_sends_to_an_idle_peer_with_a_fetch_plan_when_the_holder_is_busy():
    loads = {**IDLE, "b": NodeLoad(queued_prefill_tokens=20_000)}
    plan = choose("cost", {"b": 90}, loads)
    assert plan.worker != "b"
    assert (plan.fetch_from, plan.fetch_start, plan.fetch_end) == ("b", 0, 90)
    assert plan.prefill_tokens == 1600 - 90 * 16
    chosen = next(t for t in plan.candidates if t.worker == plan.worker)
    assert chosen.transfer_s > 0 and plan.predicted_ttft_s == pytest.approx(chosen.ttft_s)


def test_cost_local_never_fetches():
    loads = {**IDLE, "b": NodeLoad(queued_prefill_tokens=20_000)}
    plan = choose("cost_local", {"b": 90}, loads)
    assert plan.fetch_from is None and plan.worker != "b" and plan.prefill_tokens == 1600


def test_fetch_is_skipped_when_the_link_is_slower_than_recompute():
    slow_link = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=1e9, link_bytes_per_s=1e3)
    loads = {**IDLE, "b": NodeLoad(queued_prefill_tokens=10**9)}
    plan = choose("cost", {"b": 90}, loads, costs=slow_link)
    assert plan.worker != "b" and plan.fetch_from is None


def test_fetch_extends_a_shorter_local_prefix():
    plan = choose("cost", {"a": 20, "b": 90}, {"a": NodeLoad(), "b": NodeLoad(queued_prefill_tokens=50_000)})
    assert plan.worker == "a" and (plan.fetch_start, plan.fetch_end, plan.fetch_from) == (20, 90, "b")


def test_longest_prefix_ignores_load_and_least_load_ignores_matches():
    loads = {**IDLE, "b": NodeLoad(queued_prefill_tokens=10**6)}
    assert choose("longest_prefix", {"b": 90, "a": 10}, loads).worker == "b"
    assert choose("least_load", {"b": 90}, {"a": NodeLoad(5), "b": NodeLoad(10), "c": NodeLoad(1)}).worker == "c"


def test_round_robin_rotates_and_random_is_seeded():
    rr = policies()["round_robin"]
    picked = [rr(REQ, {}, IDLE, COSTS, random.Random(0)).worker for _ in range(6)]
    assert picked == ["a", "b", "c", "a", "b", "c"]
    first = [policies()["random"](REQ, {}, IDLE, COSTS, random.Random(7)).worker for _ in range(3)]
    assert first == [policies()["random"](REQ, {}, IDLE, COSTS, random.Random(7)).worker for _ in range(3)]


def test_fully_cached_prompt_still_computes_one_token():
    plan = choose("cost", {"a": 100}, IDLE)
    assert plan.prefill_tokens == 1


def test_profiles_scale_block_bytes():
    assert profile("llama-3-70b-a800", 512).block_bytes == 512 * 320 * 1024
    with pytest.raises(ValueError):
        profile("nope", 16)


@given(st.dictionaries(st.sampled_from("abcd"), st.integers(1, 100)),
       st.dictionaries(st.sampled_from("abcd"), st.integers(0, 10**6), min_size=1),
       st.sampled_from(sorted(policies())))
def test_every_plan_is_consistent(matches, queued, name):
    loads = {n: NodeLoad(q) for n, q in queued.items()}
    plan = choose(name, matches, loads)
    assert plan.worker in loads
    assert plan.local_blocks == matches.get(plan.worker, 0) == plan.fetch_start
    assert plan.fetch_start <= plan.fetch_end <= REQ.num_blocks
    if plan.fetch_from is None:
        assert plan.fetch_end == plan.fetch_start
    else:
        assert plan.fetch_from != plan.worker and matches[plan.fetch_from] >= plan.fetch_end
    assert 1 <= plan.prefill_tokens <= REQ.num_prompt_tokens
    assert {t.worker for t in plan.candidates} == set(loads)


VLLM_LIKE = RouteRequest(num_prompt_tokens=1600, num_blocks=100, transfer_nodes=frozenset())  # nobody fetches


def test_cost_keeps_a_held_prefix_against_a_short_queue_but_not_a_long_one():
    """The holder's queue (1000 tokens) is shorter than the prefix another node would recompute
    twice over (its TTFT, then the work later requests wait behind); a 5000-token queue is not."""
    myopic = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=1000.0, lost_reuse_weight=0.0)
    short = {"a": NodeLoad(), "b": NodeLoad(queued_prefill_tokens=1000)}
    assert choose("cost", {"b": 50}, short, VLLM_LIKE, myopic).worker == "a"  # 800 cached < 1000 queued
    plan = choose("cost", {"b": 50}, short, VLLM_LIKE)
    assert plan.worker == "b" and plan.local_blocks == 50
    a = next(t for t in plan.candidates if t.worker == "a")
    assert a.lost_reuse_s == pytest.approx(2.0 * 0.8) and a.cost_s > a.ttft_s
    assert plan.predicted_ttft_s == pytest.approx(next(t for t in plan.candidates if t.worker == "b").ttft_s)
    long = {"a": NodeLoad(), "b": NodeLoad(queued_prefill_tokens=5000)}
    assert choose("cost", {"b": 50}, long, VLLM_LIKE).worker == "a"


def test_lost_reuse_is_zero_for_a_cold_prompt_and_for_a_full_fetch():
    cold = choose("cost", {}, IDLE)
    assert all(t.lost_reuse_s == 0 for t in cold.candidates)
    plan = choose("cost", {"b": 90}, {**IDLE, "b": NodeLoad(queued_prefill_tokens=20_000)})
    chosen = next(t for t in plan.candidates if t.worker == plan.worker)
    assert plan.fetch_end == 90 and chosen.lost_reuse_s == pytest.approx(0.0)
    with pytest.raises(ValueError):
        CostModel(lost_reuse_weight=-1.0)


NODES = "abcdef"


@given(st.dictionaries(st.sampled_from(NODES), st.integers(1, 100)),
       st.dictionaries(st.sampled_from(NODES), st.tuples(st.integers(0, 10**5), st.integers(0, 8)), min_size=1),
       st.none() | st.frozensets(st.sampled_from(NODES)),
       st.sampled_from(sorted(policies())), st.integers(0, 3))
def test_the_fast_path_plans_as_the_explained_path_does(matches, queued, movable, name, calls):
    """Without `explain` a policy skips the per-candidate breakdown, never the decision."""
    loads = {n: NodeLoad(q, r) for n, (q, r) in queued.items()}
    request = RouteRequest(1600, 100, {n: {"host": b // 2} for n, b in matches.items() if b > 1}, movable)
    costs = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=1000.0, link_bytes_per_s=1e8,
                      decode_step_s=0.01)
    fast, explained = policies()[name], policies()[name]
    for seed in range(calls + 1):  # round_robin moves on at each call, random draws from its rng
        quick = fast(request, matches, loads, costs, random.Random(seed))
        full = explained(request, matches, loads, costs, random.Random(seed), explain=True)
        assert quick.candidates == () and len(full.candidates) == len(loads)
        assert replace(quick, candidates=full.candidates) == full


def best_peer(worker, local, matches, movable):
    """The peer a worker fetches from at most, by brute force over every node (the oracle)."""
    if movable is not None and worker not in movable:
        return None
    return max(((b, n) for n, b in matches.items() if n != worker and b > local and (movable is None or n in movable)),
               default=(0, None))[1]


@given(st.dictionaries(st.sampled_from(NODES), st.integers(1, 100)),
       st.dictionaries(st.sampled_from(NODES), st.integers(0, 10**5), min_size=1),
       st.none() | st.frozensets(st.sampled_from(NODES)))
def test_a_candidate_fetches_only_from_its_best_peer(matches, queued, movable):
    loads = {n: NodeLoad(q) for n, q in queued.items()}
    request = RouteRequest(1600, 100, transfer_nodes=movable)
    plan = choose("cost", matches, loads, request=request, costs=CostModel(block_size=16, block_bytes=16,
                                                                            prefill_tokens_per_s=1000.0))
    for terms in plan.candidates:  # 16-byte blocks on a 10 GB/s link: fetching a longer prefix always pays
        assert terms.fetch_from == best_peer(terms.worker, terms.local_blocks, matches, movable)
