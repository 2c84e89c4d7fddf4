"""The cost policy prices a host or SSD hit between a device hit and a recompute."""

import random

from prefixpool.router.cost_model import CostModel
from prefixpool.router.policy import NodeLoad, RouteRequest, policies

COSTS = CostModel(block_size=16, block_bytes=16 * 128 * 1024, prefill_tokens_per_s=10_000.0)


def ttft(lower: dict[str, int]) -> float:
    request = RouteRequest(num_prompt_tokens=1024, num_blocks=64, lower_tier_blocks={"a": lower} if lower else {})
    plan = policies()["cost_local"](request, {"a": 64}, {"a": NodeLoad()}, COSTS, random.Random(0), explain=True)
    return plan.predicted_ttft_s


def test_tier_reads_sit_between_device_hit_and_recompute():
    recompute = COSTS.prefill_s(1024, 0)
    device, host, disk = ttft({}), ttft({"host": 64}), ttft({"disk": 64})
    assert device < host < disk < recompute
    assert host - device == COSTS.tier_read_s("host", 64)
    assert COSTS.tier_read_s("disk", 4) == COSTS.tier_read_s("ssd", 4) > 0 == COSTS.tier_read_s("device", 4)


def test_a_device_hit_beats_the_same_prefix_on_ssd_elsewhere():
    request = RouteRequest(num_prompt_tokens=1024, num_blocks=64, lower_tier_blocks={"b": {"disk": 64}})
    loads = {"a": NodeLoad(), "b": NodeLoad()}
    plan = policies()["cost_local"](request, {"a": 64, "b": 64}, loads, COSTS, random.Random(0), explain=True)
    assert plan.worker == "a"
    [_, b] = plan.candidates
    assert b.tier_read_s > 0 and plan.explain()["candidates"][1]["tier_read_s"] == b.tier_read_s
