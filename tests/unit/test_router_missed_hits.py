"""The router counts the reuse its plan promised against what the worker reports.

A plan counts on the blocks the index says the chosen worker holds; a worker that evicted them
after the index saw them (vLLM under a full cache) reports fewer cached tokens. The router's
metrics name both: missed blocks (planned, recomputed) and unplanned ones (reused, not yet
indexed). A real Router and policy; the index view and the worker answers are written by hand
so each case is exact. Block size 4, byte tokens: a 17-character prompt has 4 full blocks.
"""

from __future__ import annotations

import asyncio

import pytest

from prefixpool.model.tokenizer import ByteTokenizer
from prefixpool.contract.worker_api import Done, Token, Usage
from prefixpool.router.cost_model import CostModel
from prefixpool.router.openai_schema import CompletionBody
from prefixpool.router.policy import Plan
from prefixpool.router.service import Router, RouterConfig
from prefixpool.store.keys import Namespace
from tests.unit.test_router_retry import ScriptedClient, View

BLOCK = 4


class HoldingView(View):
    """The index says worker `a` holds `held` blocks of every prompt, `b` none."""

    def __init__(self, held: int) -> None:
        super().__init__(["a", "b"])
        self.held = held

    def longest_prefix(self, keys) -> dict[str, int]:
        return {"a": min(self.held, len(keys))} if self.held else {}


def counters(prompt: str, held: int, cached_tokens: int, policy: str = "cost", requests: int = 1) -> dict[str, float]:
    """Route a prompt `requests` times, its worker reporting `cached_tokens`; the router's plan counters after."""
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=1, local_hit_tokens=cached_tokens, fetched_tokens=0,
                  computed_tokens=len(prompt) - cached_tokens, fetched_bytes=0, ttft_s=0.01)
    answer = [Token(104), Done("length", usage)]
    client = ScriptedClient({"a": answer, "b": answer})
    config = RouterConfig(model="m", namespace=Namespace("m", block_size=BLOCK), max_context=1000, vocab_size=259,
                          policy=policy)
    router = Router(config, ByteTokenizer(), HoldingView(held), client, CostModel(block_size=BLOCK))

    async def run() -> None:
        for _ in range(requests):
            async for _ in router.generate(router.prepare(CompletionBody(model="m", prompt=prompt))):
                pass

    asyncio.run(run())
    if held and policy == "cost":
        assert client.called == ["a"] * requests  # the holder, at equal load
    sample = router.metrics.registry.get_sample_value
    return {name: sample(f"prefixpool_{metric}_total") for name, metric in
            (("planned_blocks", "planned_hit_blocks"), ("missed_blocks", "missed_hit_blocks"),
             ("missed_plans", "missed_plans"), ("unplanned_blocks", "unplanned_hit_blocks"),
             ("forgone_blocks", "forgone_hit_blocks"))}


CASES = {  # prompt length, blocks the index says `a` holds, tokens the worker reports cached -> counters
    "evicted after the index saw them: missed": (17, 4, 2 * BLOCK, (4, 2, 1, 0)),
    "kept: nothing missed": (17, 4, 4 * BLOCK, (4, 0, 0, 0)),
    "reused before the index knew: unplanned": (17, 0, 2 * BLOCK, (0, 0, 0, 2)),
    # 16 tokens, all 4 blocks held: the last token is computed, so vLLM recomputes the 4th block
    "on a block boundary: one block less planned": (16, 4, 3 * BLOCK, (3, 0, 0, 0)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_plan_is_counted_against_the_workers_reuse(case):
    length, held, cached, expected = CASES[case]
    names = ("planned_blocks", "missed_blocks", "missed_plans", "unplanned_blocks", "forgone_blocks")
    assert counters("x" * length, held, cached) == dict(zip(names, (*expected, 0)))  # cost routes to the holder


def test_a_route_away_from_the_holder_counts_its_blocks_as_forgone():
    """Round robin sends one of two identical prompts to `b`, which holds nothing: `a`'s 4 blocks forgone."""
    got = counters("x" * 17, held=4, cached_tokens=0, policy="round_robin", requests=2)
    assert got["forgone_blocks"] == 4 and got["planned_blocks"] == 4


def test_hit_blocks_is_the_plans_reach_capped_by_the_last_token():
    plan = Plan("a", "b", 2, 5, 2, 0, 0.0)  # 2 local blocks and 3 fetched
    assert plan.hit_blocks(100, BLOCK) == 5
    assert plan.hit_blocks(20, BLOCK) == 4  # 20 tokens: blocks 0-3 at most, the 5th holds the last token
    assert plan.hit_blocks(1, BLOCK) == 0
