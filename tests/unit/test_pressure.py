"""The `pressure` policy and its speculative entries, on hand-built matches and loads.

Numbers (block 32, 2,000 prefill tokens/s, lost-reuse weight 2; a 544-token prompt of 17 blocks whose
first 16 node a holds, vLLM-like nodes that fetch nothing):
    a: prefill 32 tokens 0.016 s, evicts 1 block when full          0.048 s + a's queue
    b: prefill 0.272 s, lost reuse 2 x 0.256, evicts 17 blocks 0.544  1.328 s + b's queue (0.784 s with room)
"""

import random

import numpy as np
import pytest

from prefixpool.meta.fleet_load import FleetLoad, RouterLoad, decode_load, encode_load
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router.cost_model import CostModel
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.policy import NodeLoad, RouteRequest, policies
from prefixpool.router.pressure import Pressure
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.speculative import SpeculativeBlocks
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import Namespace, chain_from
from tests.support.index_view import IndexView

COSTS = CostModel(block_size=32, prefill_tokens_per_s=2000.0, lost_reuse_weight=2.0)
ROOT = Namespace("pressure-test", block_size=32).root()
PREFIX = np.arange(512, dtype=np.int32)


def request(suffix_seed: int, prefix=PREFIX) -> RouteRequest:
    ids = np.concatenate([prefix, np.random.default_rng(suffix_seed).integers(600, 900, 32, dtype=np.int32)])
    keys = chain_from(ROOT, ids, 32)
    return RouteRequest(len(ids), len(keys), transfer_nodes=frozenset(), keys=keys)


def loads(queued_a: int = 0, queued_b: int = 0, free_a: int | None = 0, free_b: int | None = 0) -> dict:
    return {"a": NodeLoad(queued_prefill_tokens=queued_a, free_blocks=free_a),
            "b": NodeLoad(queued_prefill_tokens=queued_b, free_blocks=free_b)}


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def pressure(clock=None, **kwargs) -> Pressure:
    return Pressure(clock=clock or Clock(), **kwargs)


def choose(policy, req, node_loads, matches):
    return policy(req, matches, node_loads, COSTS, random.Random(0)).worker


# -- speculative entries --------------------------------------------------------------------------


def test_speculative_entries_extend_match_confirm_and_expire():
    keys = request(0).keys
    spec = SpeculativeBlocks(ttl_s=2.0)
    spec.add("a", keys[3:], now=10.0)  # the index already names keys[:3] on a
    spec.check_integrity()
    assert spec.extend(keys, {"a": 3}) == {"a": 17}
    assert spec.extend(keys, {}) == {}, "a speculative run continues an index match; it never starts mid-prompt"
    spec.add("b", keys, now=10.5)
    assert spec.extend(keys, {}) == {"b": 17} and len(spec) == 14 + 17
    spec.confirm("b", keys[:16])  # b's KV events came back for 16 blocks
    assert spec.num_pending("b") == 1 and spec.extend(keys, {"b": 16}) == {"b": 17}
    spec.check_integrity()
    spec.expire(12.0)  # a's entries were dated 10.0: gone; b's (10.5) stay
    assert spec.num_pending("a") == 0 and spec.num_pending("b") == 1
    spec.add("b", keys[16:], now=12.0)  # routed there again: the claim is not renewed (it could outlive the block)
    spec.expire(12.6)
    assert spec.num_pending("b") == 0
    spec.add("b", keys[16:], now=13.0)  # a new claim after the old one went: its own expiry
    spec.expire(14.0)
    assert spec.num_pending("b") == 1
    spec.expire(18.0)
    assert len(spec) == 0
    spec.check_integrity()


def test_a_burst_of_a_new_prefix_stays_on_one_node_until_the_ttl():
    clock = Clock()
    policy, cost = pressure(clock, ttl_s=3.0), policies()["cost"]
    first = choose(policy, request(1), loads(free_a=None, free_b=None), {})
    busy = loads(**{f"queued_{first}": 544, "free_a": None, "free_b": None})  # the first one still prefilling
    assert choose(policy, request(2), busy, {}) == first, "the burst follows its speculative entries"
    assert choose(cost, request(2), busy, {}) != first, "without them the index is empty and the burst spreads"
    clock.now += 3.5  # no KV event ever came: the entries expire and stop steering
    choose(policy, request(3), loads(free_a=None, free_b=None), {})
    assert policy.speculative.extend(request(4).keys, {}) == {first: 16}, "only request 3's own entries remain"


def test_kv_events_confirm_speculative_entries():
    policy = pressure()
    req = request(5)
    assert choose(policy, req, loads(free_a=None, free_b=None), {}) == "a"
    assert policy.speculative.num_pending("a") == 17
    choose(policy, request(6), loads(free_a=None, free_b=None), {"a": 17 - 1})  # the index now names the prefix
    assert policy.speculative.num_pending("a") == 1 + 1, "the prefix is confirmed; two suffix blocks still pending"
    policy.speculative.check_integrity()


def test_explain_records_nothing():
    policy = pressure()
    policy(request(7), {}, loads(), COSTS, random.Random(0), explain=True)
    assert len(policy.speculative) == 0


# -- cache pressure -------------------------------------------------------------------------------


@pytest.mark.parametrize("queued_a, full_b, expected", [
    (0, True, "a"),
    (2000, True, "a"),  # a 1 s queue: a second copy on a full b would evict 17 blocks: not worth it
    (2000, False, "b"),  # the same queue, b with room: the copy evicts nothing
    (3000, True, "b"),  # 1.5 s of queue: the prefix's load needs two nodes
])
def test_a_second_copy_only_under_load(queued_a, full_b, expected):
    node_loads = loads(queued_a=queued_a, free_b=0 if full_b else 100)
    assert choose(pressure(), request(8), node_loads, {"a": 16}) == expected


def test_the_cost_policy_copies_sooner():
    assert choose(policies()["cost"], request(9), loads(queued_a=2000), {"a": 16}) == "b"


def test_an_unknown_cache_size_is_not_priced():
    policy = pressure()
    plan = policy(request(10), {"a": 16}, loads(free_a=None, free_b=None), COSTS, random.Random(0), explain=True)
    assert all(t.evict_s == 0 for t in plan.candidates)


def test_speculative_blocks_fill_a_cache():
    policy = pressure()
    room = loads(free_a=17, free_b=17)
    choose(policy, request(11), room, {})  # a: 17 blocks pending, its 17 free blocks now spoken for
    plan = policy(request(12, prefix=PREFIX + 1000), {}, room, COSTS, random.Random(0), explain=True)
    evict = {t.worker: t.evict_s for t in plan.candidates}
    assert evict["a"] > 0 and evict["b"] == 0 and plan.worker == "b"


# -- bounded tail ---------------------------------------------------------------------------------


LONG = np.arange(3168, dtype=np.int32)  # 99 blocks + a 1-block suffix: a copy on b is priced at ~8 s


@pytest.mark.parametrize("queued_a, expected", [(8000, "a"), (12_000, "b")])
def test_a_holders_queue_is_bounded_whatever_its_prefix_is_worth(queued_a, expected):
    """b computes the whole 3,200-token prompt in 1.6 s, so a may take up to 2 x 1.6 + 2 = 5.2 s: a queue
    of 4 s keeps it there, 6 s does not, though the prices (lost reuse and eviction, about 6.4 s) favour a."""
    node_loads = loads(queued_a=queued_a)
    assert choose(pressure(), request(13, prefix=LONG), node_loads, {"a": 99}) == expected
    assert choose(pressure(max_ttft_gap_s=1e9), request(13, prefix=LONG), node_loads, {"a": 99}) == "a", "unbounded"


def test_the_tail_bound_spills_only_where_it_is_faster():
    node_loads = loads(queued_a=16_000, queued_b=12_000)  # a 8.0 s, b 6 s + 1.6 s of prefill: within the bound
    assert choose(pressure(), request(14, prefix=LONG), node_loads, {"a": 99}) == "a"


def test_requests_in_flight_bound_a_holder_whose_queue_its_hits_hide():
    """Hits prefill 32 tokens each: 20 of them queued on a look like 0.3 s, a queue vLLM on a CPU takes
    seconds to clear; past 2 x b's requests + 4, b takes the request though it must recompute."""
    busy = {"a": NodeLoad(queued_prefill_tokens=20 * 32, num_running=20, free_blocks=0),
            "b": NodeLoad(queued_prefill_tokens=3 * 544, num_running=3, free_blocks=0)}
    assert choose(pressure(), request(15), busy, {"a": 16}) == "b"
    calmer = {**busy, "a": NodeLoad(queued_prefill_tokens=10 * 32, num_running=10, free_blocks=0)}
    assert choose(pressure(), request(15), calmer, {"a": 16}) == "a"


# -- through the router ---------------------------------------------------------------------------


class _Worker:
    def __init__(self, node_id: str, num_blocks: int) -> None:
        self.node_id, self.http_url, self.transfer_url = node_id, f"http://{node_id}", ""
        self.num_queued = self.num_running = 0
        self.num_blocks, self.kind = num_blocks, "vllm"  # vLLM nodes: no block transfers


class _View(IndexView):
    """Two vLLM-like nodes of 64 blocks over a real BlockIndex, no other router."""

    def __init__(self) -> None:
        super().__init__({n: _Worker(n, 64) for n in ("a", "b")})


def _router(view: _View) -> Router:
    config = RouterConfig(model="tiny", namespace=Namespace("tiny", block_size=4), max_context=4096, vocab_size=259,
                          policy="pressure")
    return Router(config, ByteTokenizer(), view, WorkerClient(), CostModel(block_size=4, prefill_tokens_per_s=2000.0))


def test_the_router_records_what_it_routes_and_prices_a_full_node():
    view = _View()
    router = _router(view)
    prompt = "a shared system prompt of a few blocks. "
    first = router.prepare(CompletionBody(model="tiny", prompt=prompt + "one"))
    explained = router.explain(first)
    assert router._choose.speculative.num_pending(explained["worker"]) == 0, "/v1/route routes nothing"
    plan, matches = router.decide(first)
    router.inflight.begin(plan.worker, plan.prefill_tokens)  # still prefilling: the index knows nothing yet
    second = router.prepare(CompletionBody(model="tiny", prompt=prompt + "two"))
    assert router.decide(second)[0].worker == plan.worker, "the speculative entries keep the burst together"
    other = "b" if plan.worker == "a" else "a"
    view.index.add(other, router.prepare(CompletionBody(model="tiny", prompt="x" * 256)).keys)  # full: 64 blocks
    priced = {c["worker"]: c["evict_s"] for c in router.explain(second)["candidates"]}
    assert priced[other] > 0 and priced[plan.worker] == 0


# -- shared between routers -----------------------------------------------------------------------


def test_other_routers_routed_keys_count_until_their_ttl():
    clock = Clock()
    fleet = FleetLoad(routed_ttl_s=5.0, clock=clock)
    keys = request(15).keys
    entry = RouterLoad("r2", {"b": (1, 544)}, "http://r2", {"b": list(keys)})
    assert decode_load(encode_load(entry)) == entry
    fleet.put(decode_load(encode_load(entry)), revision=3)
    fleet.put(RouterLoad("r3", {}, "", {"a": list(keys[:4])}), revision=4)
    assert fleet.routed(keys, exclude="me") == {"b": 17, "a": 4}
    assert fleet.routed(keys, exclude="r2") == {"a": 4}, "a router's own entry is never read back"
    assert fleet.routed(request(16, prefix=PREFIX + 1000).keys) == {}
    clock.now += 5.5
    assert fleet.routed(keys) == {}, "past the TTL a router's routed keys no longer count"
    assert fleet.share("b") == (1, 544), "its load still does (the lease decides that)"


def test_a_router_is_active_while_it_has_work_in_flight_or_changed_its_entry_lately():
    clock = Clock()
    fleet = FleetLoad(clock=clock)
    fleet.put(RouterLoad("me", {"a": (3, 10)}), revision=1)
    fleet.put(RouterLoad("idle", {}), revision=2)
    fleet.put(RouterLoad("busy", {"a": (1, 0), "b": (0, 0)}), revision=3)
    assert fleet.active(exclude="me", within_s=2.0) == 2  # both just put
    clock.now += 2.5
    assert fleet.active(exclude="me", within_s=2.0) == 1, "only the one with a request in flight"
    fleet.put(RouterLoad("busy", {"a": (0, 0)}), revision=4)
    assert fleet.active(exclude="me", within_s=2.0) == 1, "its last change was just now"
    clock.now += 2.5
    assert fleet.active(exclude="me", within_s=2.0) == 0 and fleet.active(exclude="x", within_s=2.0) == 1


def test_the_router_publishes_its_speculative_entries_and_reads_the_others():
    view = _View()
    router = _router(view)
    prompt = "another shared system prompt, a few blocks long. "
    mine = router.prepare(CompletionBody(model="tiny", prompt=prompt + "one"))
    view.fleet.put(RouterLoad("r2", {}, "", {"b": list(mine.keys)}), revision=2)  # r2 just sent it to b
    plan, matches = router.decide(mine)
    assert plan.worker == "b" and matches["b"] == len(mine.keys), "the other router's entries steer this one"
    assert router.inflight.routed() == {}, "nothing of its own to publish: b is already counted as holding it"
    fresh = router.prepare(CompletionBody(model="tiny", prompt="an unrelated prompt of some length. " * 2))
    plan, _ = router.decide(fresh)
    assert set(router.inflight.routed()[plan.worker]) >= set(fresh.keys), "what it routes is what it publishes"
