"""The handoff cost the router learns (HandoffCosts), vLLM pairs priced sequentially, and /v1/route showing both."""

import asyncio

import pytest

from prefixpool.contract.worker_api import Done, GenerateRequest, SamplingParams, Usage
from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.router.conductor import DISAGGREGATED, IN_PLACE, ConductorConfig, HandoffCosts, conduct
from prefixpool.router.cost_model import CostModel
from prefixpool.router.fleet import OWN_KIND
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.policy import NodeLoad, RouteRequest
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.vllm_pair import VLLM_KIND, pair_stream
from prefixpool.router.worker_client import WorkerClient
from prefixpool.store.keys import Namespace
from tests.support.index_view import IndexView

COSTS = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=10_000.0, link_bytes_per_s=1e9)
ROLES = {"p": "prefill", "d": "decode"}
BUSY = {"p": NodeLoad(), "d": NodeLoad(num_running=3)}  # the decode node is decoding: compute there stalls 4
MEDIUM = RouteRequest(num_prompt_tokens=56, num_blocks=3)
LONG = RouteRequest(num_prompt_tokens=2000, num_blocks=125)


def test_the_estimate_starts_at_the_configured_setup_and_moves_toward_what_is_observed():
    handoffs = HandoffCosts(0.005)
    assert handoffs.setup_s(OWN_KIND) == handoffs.setup_s(VLLM_KIND) == 0.005
    handoffs.observe(OWN_KIND, 0.040)
    assert 0.005 < handoffs.setup_s(OWN_KIND) < 0.040  # one sample: halfway
    for _ in range(3):
        handoffs.observe(OWN_KIND, 0.040)
    assert handoffs.setup_s(OWN_KIND) == pytest.approx(0.040)
    assert handoffs.setup_s(VLLM_KIND) == 0.005, "per kind"
    handoffs.observe(OWN_KIND, 5.0)  # one fault-stalled handoff among several does not move the median
    assert handoffs.setup_s(OWN_KIND) == pytest.approx(0.040)
    handoffs.observe(OWN_KIND, -1.0)  # faster than priced: counted as no setup
    shown = handoffs.explain()
    assert shown["configured_setup_s"] == 0.005 and shown["learned"][OWN_KIND]["samples"] == 6
    assert shown["learned"][OWN_KIND]["last_s"] == 0.0 and VLLM_KIND not in shown["learned"]


def test_slow_handoffs_seen_flip_a_short_prompt_from_disaggregated_to_in_place():
    handoffs = HandoffCosts(0.005)
    before = conduct(MEDIUM, {}, ROLES, BUSY, COSTS, handoffs=handoffs)
    assert before.terms.mode == DISAGGREGATED and before.terms.setup_s == 0.005
    for _ in range(4):
        handoffs.observe(OWN_KIND, 0.040)
    after = conduct(MEDIUM, {}, ROLES, BUSY, COSTS, handoffs=handoffs, explain=True)
    assert after.terms.mode == IN_PLACE and after.prefill is None
    split = next(a for a in after.alternatives if a.mode == DISAGGREGATED)
    assert split.setup_s == pytest.approx(0.040) and split.handoff_kind == OWN_KIND
    assert after.explain()["disaggregation"]["handoff"]["learned"][OWN_KIND]["setup_s"] == pytest.approx(0.040)
    # a long prompt still pays for a 40 ms handoff
    assert conduct(LONG, {}, ROLES, BUSY, COSTS, handoffs=handoffs).terms.mode == DISAGGREGATED


def test_a_vllm_pair_is_priced_sequentially_and_keeps_in_place_what_overlap_would_split():
    slow_link = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=10_000.0, link_bytes_per_s=1e7)
    idle = {"p": NodeLoad(), "d": NodeLoad()}
    ours = conduct(LONG, {}, ROLES, idle, slow_link)
    assert ours.terms.mode == DISAGGREGATED and not ours.terms.sequential
    assert ours.terms.exposed_transfer_s < ours.terms.transfer_s  # overlapped with the prefill
    vllm = {"p": VLLM_KIND, "d": VLLM_KIND}
    plan = conduct(LONG, {}, ROLES, idle, slow_link, kinds=vllm, explain=True)
    assert plan.terms.mode == IN_PLACE
    pair = next(a for a in plan.alternatives if a.mode == DISAGGREGATED)
    assert pair.sequential and pair.handoff_kind == VLLM_KIND
    assert pair.exposed_transfer_s == pytest.approx(slow_link.transfer_s(125))
    assert pair.ttft_s == pytest.approx(pair.queue_s + pair.prefill_s + pair.transfer_s + pair.tail_s + pair.setup_s)
    assert pair.cost_s > ours.terms.cost_s
    # a vLLM pair's setup is its own kind's estimate
    handoffs = HandoffCosts(0.005)
    handoffs.observe(VLLM_KIND, 0.3)
    priced = conduct(LONG, {}, ROLES, idle, slow_link, ConductorConfig(interference_weight=10.0), kinds=vllm,
                     handoffs=handoffs)
    assert priced.terms.mode == DISAGGREGATED and priced.terms.setup_s == pytest.approx(handoffs.setup_s(VLLM_KIND))


def test_a_vllm_pair_reports_its_prefill_round_trip_only_when_the_prefill_answered():
    class Client:
        def __init__(self, params):
            self.params = params

        async def prefill(self, url, request):
            return self.params

        async def generate(self, url, request, kv_transfer_params=None):
            yield Done("length", Usage(prompt_tokens=1, completion_tokens=1, local_hit_tokens=0, fetched_tokens=0,
                                       computed_tokens=1, fetched_bytes=0, ttft_s=0.0))

    async def run(params):
        seen = []
        request = GenerateRequest(request_id="r", tokens=b"\0\0\0\0", sampling=SamplingParams(max_tokens=1))
        events = [e async for e in pair_stream(Client(params), "http://p", "http://d", request, seen.append)]
        return events, seen

    events, seen = asyncio.run(run({"pool": "p.pool"}))
    assert len(events) == 1 and len(seen) == 1 and seen[0] >= 0
    assert asyncio.run(run(None))[1] == []


class _Worker:
    def __init__(self, node_id: str, role: str) -> None:
        self.node_id, self.http_url, self.transfer_url, self.role = node_id, f"http://{node_id}", f"t://{node_id}", role
        self.num_queued = self.num_running = 0


class _View(IndexView):
    def __init__(self) -> None:
        super().__init__({"p": _Worker("p", "prefill"), "d": _Worker("d", "decode")})

    def held_blocks(self, node_id):
        return 0


def test_the_router_learns_from_complete_handoffs_and_route_shows_the_learned_value():
    config = RouterConfig(model="tiny", namespace=Namespace("tiny", block_size=16), max_context=4096,
                          vocab_size=259, conductor=ConductorConfig(interference_weight=4.0))
    router = Router(config, ByteTokenizer(), _View(), WorkerClient(), COSTS)
    prepared = router.prepare(CompletionBody(model="tiny", prompt="x" * 1000))
    plan, _ = router.decide(prepared)
    assert plan.prefill is not None and plan.prefill.worker == "p"
    blocks = plan.fetch_end - plan.fetch_start
    measured_prefill = 0.01  # the prefill node's own ttft_s: the price (plan.terms.prefill_s) plays no part
    ready = measured_prefill + plan.terms.exposed_transfer_s

    def usage(fetched_blocks: int, handoff_s: float) -> Usage:
        return Usage(prompt_tokens=1000, completion_tokens=1, local_hit_tokens=0, fetched_tokens=fetched_blocks * 16,
                     computed_tokens=1000 - fetched_blocks * 16, fetched_bytes=0, ttft_s=0.0, handoff_s=handoff_s)

    router._learn_handoff(plan, usage(blocks - 1, ready + 9.0), measured_prefill)  # incomplete: a fault
    router._learn_handoff(plan, usage(blocks, ready + 9.0), None)  # the prefill node did not finish: unknown
    assert router.handoffs.setup_s(OWN_KIND) == 0.005
    for _ in range(3):
        router._learn_handoff(plan, usage(blocks, ready + 0.5), measured_prefill)
    assert router.handoffs.setup_s(OWN_KIND) == pytest.approx(0.5)
    shown = router.explain(prepared)["disaggregation"]
    assert shown["handoff"]["learned"][OWN_KIND]["setup_s"] == pytest.approx(0.5)
    assert shown["handoff"]["configured_setup_s"] == 0.005
    router._learn_vllm_handoff(plan, plan.terms.queue_s + plan.terms.prefill_s + 0.25)
    assert router.handoffs.setup_s(VLLM_KIND) == pytest.approx((0.005 + 0.25) / 2)
