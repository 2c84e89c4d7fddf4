"""Trace replay (simulated): the ordering the issue names, on a slice of the real trace."""

import dataclasses
import json

import pytest

from prefixpool.deploy.cli import main
from prefixpool.replay.simulator import SimConfig, hit_rate_bound, simulate
from prefixpool.replay.trace import TRACES_DIR, load_trace, tokens_of
from prefixpool.router.cost_model import profile

COSTS = profile("llama-3-70b-a800", 512)


@pytest.fixture(scope="module")
def conversation():
    return load_trace("conversation", limit=2500)


@pytest.fixture(scope="module")
def results(conversation):
    config = SimConfig(num_nodes=8, capacity_blocks=1000, costs=COSTS)
    return {p: simulate(conversation, p, config) for p in ["cost", "cost_local", "least_load", "longest_prefix"]}


def test_cost_beats_least_load_and_local_only(results):
    mean = {p: r.ttft_s.mean() for p, r in results.items()}
    assert mean["cost"] <= mean["least_load"]
    assert mean["cost"] <= mean["cost_local"]
    assert results["cost"].hit_rate > results["cost_local"].hit_rate > results["least_load"].hit_rate


def test_longest_prefix_piles_up_on_one_node(results):
    assert results["longest_prefix"].imbalance > 2 * results["cost"].imbalance
    assert results["longest_prefix"].imbalance > 2 * results["least_load"].imbalance


def test_unlimited_capacity_reaches_the_bound_computed_independently(conversation):
    seen, hits, total = set(), 0, 0
    with open(TRACES_DIR / "conversation_trace.jsonl") as lines:
        for _, line in zip(range(len(conversation)), lines):
            raw = json.loads(line)
            k = next((i for i, h in enumerate(raw["hash_ids"]) if h not in seen), len(raw["hash_ids"]))
            hits += min(k * 512, raw["input_length"])
            total += raw["input_length"]
            seen.update(raw["hash_ids"])
    unlimited = simulate(conversation, "cost", SimConfig(num_nodes=8, capacity_blocks=None, costs=COSTS))
    assert hit_rate_bound(conversation) == pytest.approx(hits / total)
    # Blocks enter a node's cache when their prefill ends, so a request arriving while its
    # prefix is still being computed misses: the simulated rate sits just under the bound.
    assert hits / total - 1e-3 <= unlimited.hit_rate <= hits / total


def test_full_traces_match_the_published_bounds():
    assert hit_rate_bound(load_trace("conversation")) == pytest.approx(0.374, abs=5e-4)
    assert hit_rate_bound(load_trace("synthetic")) == pytest.approx(0.651, abs=5e-4)


def test_tokens_are_deterministic_per_block_id(conversation):
    a, b = conversation[0], conversation[1]
    ta, tb = tokens_of(a, 16, 500), tokens_of(b, 16, 500)
    shared = next(i for i, (x, y) in enumerate(zip(a.hash_ids + (None,), b.hash_ids + (-1,))) if x != y)
    assert ta[: shared * 16] == tb[: shared * 16] and shared >= 1
    assert tokens_of(a, 16, 500) == ta and all(1 <= t < 500 for t in ta)


def test_cli_writes_report_and_plots(tmp_path, capsys):
    assert main(["replay", "synthetic", "--limit", "300", "--nodes", "4", "--sweep", "100,0",
                 "--policies", "cost,least_load", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| cost |" in out and "| least_load |" in out
    assert {p.name for p in tmp_path.glob("*.png")} == {
        "replay_synthetic_ttft_cdf.png", "replay_synthetic_hit_vs_capacity.png", "replay_synthetic_node_load.png"}
    assert (tmp_path / "replay_synthetic.md").read_text().startswith("### synthetic")


def test_the_bound_with_lru_caches_evicts_a_chains_tail_first():
    from prefixpool.replay.trace import TraceRecord

    records = [TraceRecord(0, 1024, 1, (1, 2)), TraceRecord(1, 1024, 1, (3, 4)), TraceRecord(2, 1024, 1, (1, 2))]
    # after the first two requests the LRU order is 2, 1, 4, 3 (each request's head touched last)
    assert hit_rate_bound(records, capacity_blocks=4) == pytest.approx(1024 / 3072)  # 1, 2 both kept
    assert hit_rate_bound(records, capacity_blocks=3) == pytest.approx(512 / 3072)  # 2 evicted: the head 1 hits
    assert hit_rate_bound(records, capacity_blocks=2) == 0.0
    assert hit_rate_bound(records, capacity_blocks=None) == hit_rate_bound(records)


def test_the_lru_bound_agrees_with_the_simulated_pool_when_prefill_is_instant():
    records = load_trace("conversation", limit=600)
    instant = dataclasses.replace(COSTS, prefill_tokens_per_s=1e12, attention_s_per_token_pair=0.0)
    for capacity in (1000, 4000):
        simulated = simulate(records, "cost_local", SimConfig(num_nodes=1, capacity_blocks=capacity, costs=instant))
        assert hit_rate_bound(records, capacity_blocks=capacity) == pytest.approx(simulated.hit_rate, abs=3e-3)
    assert hit_rate_bound(records, capacity_blocks=4000) < hit_rate_bound(records) / 2  # the slice's reuse is far apart
