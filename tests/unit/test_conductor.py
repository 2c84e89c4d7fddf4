"""The conductor's decisions on hand-built fleets: who prefills, who decodes, or in place, and why."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.router.conductor import (DISAGGREGATED, IN_PLACE, ConductorConfig, conduct, is_disaggregated)
from prefixpool.router.cost_model import CostModel
from prefixpool.router.policy import NodeLoad, Plan, RouteRequest

COSTS = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=10_000.0, link_bytes_per_s=1e9)
ROLES = {"p": "prefill", "d": "decode"}
IDLE = {"p": NodeLoad(), "d": NodeLoad()}
LONG = RouteRequest(num_prompt_tokens=2000, num_blocks=125)  # 2000 = 125 x 16: the last token is recomputed
SHORT = RouteRequest(num_prompt_tokens=40, num_blocks=2)


def test_a_long_uncached_prompt_is_prefilled_on_the_prefill_node_and_handed_to_the_decode_node():
    plan = conduct(LONG, {}, ROLES, IDLE, COSTS, explain=True)
    assert isinstance(plan, Plan) and plan.terms.mode == DISAGGREGATED
    assert plan.prefill.worker == "p" and plan.worker == plan.decode == "d"
    assert (plan.fetch_from, plan.fetch_start, plan.fetch_end) == ("p", 0, 125)
    assert plan.prefill_tokens == 1  # the decode node computes only the last token (the prompt ends on a block)
    assert plan.prefill.prefill_tokens == 2000 and plan.prefill.fetch_from is None
    assert plan.predicted_ttft_s == pytest.approx(plan.terms.ttft_s)
    shown = plan.explain()
    assert shown["prefill"]["node"] == "p" and shown["decode"]["node"] == "d"
    assert shown["decode"]["fetch"] == {"from": "p", "start_block": 0, "end_block": 125}
    assert shown["disaggregation"]["mode"] == DISAGGREGATED and "in place on d" in shown["disaggregation"]["why"]
    assert {t["mode"] for t in shown["disaggregation"]["alternatives"]} == {IN_PLACE, DISAGGREGATED}


def test_the_transfer_overlaps_the_prefill_so_only_what_outlasts_it_is_waited():
    plan = conduct(LONG, {}, ROLES, IDLE, COSTS)
    terms = plan.terms
    assert terms.moved_blocks == 125 and terms.transfer_s == pytest.approx(COSTS.transfer_s(125))
    assert terms.exposed_transfer_s == pytest.approx(COSTS.transfer_s(1))  # the link outruns the prefill
    slow_link = CostModel(block_size=16, block_bytes=16 * 1024, prefill_tokens_per_s=10_000.0, link_bytes_per_s=1e7)
    slow = conduct(LONG, {}, ROLES, IDLE, slow_link, ConductorConfig(interference_weight=10.0)).terms
    assert slow.exposed_transfer_s == pytest.approx(slow_link.transfer_s(125) - slow.prefill_s)


def test_a_short_prompt_is_served_in_place_on_the_decode_node():
    plan = conduct(SHORT, {}, ROLES, IDLE, COSTS, explain=True)
    assert plan.terms.mode == IN_PLACE and plan.prefill is None and plan.worker == "d"
    assert plan.explain()["prefill"] is None and "in place on d" in plan.reason


def test_a_prefix_the_decode_node_holds_keeps_the_request_in_place():
    plan = conduct(LONG, {"d": 120}, ROLES, IDLE, COSTS)
    assert plan.terms.mode == IN_PLACE and plan.worker == "d" and plan.local_blocks == 120


def test_busy_decoding_makes_a_short_prompt_worth_disaggregating():
    medium = RouteRequest(num_prompt_tokens=56, num_blocks=3)
    assert conduct(medium, {}, ROLES, IDLE, COSTS).terms.mode == IN_PLACE
    busy = {"p": NodeLoad(), "d": NodeLoad(num_running=8)}
    plan = conduct(medium, {}, ROLES, busy, COSTS)
    in_place = next(a for a in conduct(medium, {}, ROLES, busy, COSTS, explain=True).alternatives
                    if a.mode == IN_PLACE)
    assert plan.terms.mode == DISAGGREGATED and plan.terms.interference_s < in_place.interference_s / 5


def test_the_prefill_node_holding_the_prefix_or_idle_is_chosen():
    roles = {"p1": "prefill", "p2": "prefill", "d": "decode"}
    loads = {"p1": NodeLoad(), "p2": NodeLoad(), "d": NodeLoad()}
    assert conduct(LONG, {"p2": 60}, roles, loads, COSTS).prefill.worker == "p2"
    busy = {**loads, "p1": NodeLoad(queued_prefill_tokens=50_000)}
    assert conduct(LONG, {}, roles, busy, COSTS).prefill.worker == "p2"


def test_the_decode_node_is_chosen_by_load_free_blocks_and_what_it_holds():
    roles = {"p": "prefill", "d1": "decode", "d2": "decode"}
    idle = {"p": NodeLoad(), "d1": NodeLoad(), "d2": NodeLoad()}
    loaded = {**idle, "d1": NodeLoad(num_running=6, queued_prefill_tokens=5000)}
    assert conduct(LONG, {}, roles, loaded, COSTS).worker == "d2"
    assert conduct(LONG, {}, roles, idle, COSTS, free_blocks={"d1": 10, "d2": None}).worker == "d2"
    holder = conduct(LONG, {"d2": 40}, roles, idle, COSTS)
    assert holder.worker == "d2" and holder.terms.mode == DISAGGREGATED
    assert (holder.fetch_from, holder.fetch_start, holder.fetch_end, holder.terms.moved_blocks) == ("p", 40, 125, 85)


def test_without_a_pair_the_fleet_serves_in_place():
    assert conduct(LONG, {}, {"d": "decode"}, {"d": NodeLoad()}, COSTS).worker == "d"
    alone = conduct(LONG, {}, {"p": "prefill"}, {"p": NodeLoad()}, COSTS)  # only a prefill node alive: it serves
    assert alone.worker == "p" and alone.terms.mode == IN_PLACE and "no prefill and decode" in alone.reason
    vllm_only = RouteRequest(2000, 125, transfer_nodes=frozenset({"d"}))  # p cannot send blocks
    assert conduct(vllm_only, {}, ROLES, IDLE, COSTS).terms.mode == IN_PLACE


def test_a_both_node_serves_in_place_beside_a_pair():
    roles = {**ROLES, "b": "both"}
    loads = {**IDLE, "b": NodeLoad()}
    plan = conduct(LONG, {"b": 124}, roles, loads, COSTS)
    assert plan.worker == "b" and plan.terms.mode == IN_PLACE
    assert conduct(LONG, {}, roles, loads, COSTS).terms.mode == DISAGGREGATED


def test_is_disaggregated_only_with_a_prefill_or_decode_role():
    assert not is_disaggregated({"a": "both", "b": "both"}) and is_disaggregated({"a": "both", "b": "decode"})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2), st.integers(1, 3000), st.data())
def test_the_chosen_candidate_is_the_cheapest_of_every_pair_and_in_place_node(num_p, num_d, num_b, num_tokens,
                                                                               data):
    roles = {**{f"p{i}": "prefill" for i in range(num_p)}, **{f"d{i}": "decode" for i in range(num_d)},
             **{f"b{i}": "both" for i in range(num_b)}}
    request = RouteRequest(num_tokens, num_tokens // 16)
    matches = {n: data.draw(st.integers(0, request.num_blocks)) for n in roles}
    loads = {n: NodeLoad(data.draw(st.integers(0, 5000)), data.draw(st.integers(0, 8))) for n in roles}
    plan = conduct(request, matches, roles, loads, COSTS, explain=True)
    every = []  # brute force: each in-place node alone, each (prefill, decode) pair alone
    for node in [n for n in roles if roles[n] != "prefill"]:
        every.append(conduct(request, matches, {node: roles[node]}, {node: loads[node]}, COSTS).terms.cost_s)
    by_role = {role: [n for n in roles if roles[n] == role] for role in ("prefill", "decode")}
    for p, d in itertools.product(by_role["prefill"], by_role["decode"]):
        pair = conduct(request, matches, {p: "prefill", d: "decode"}, {p: loads[p], d: loads[d]}, COSTS)
        every.append(min([pair.terms.cost_s] + [a.cost_s for a in pair.alternatives if a.mode == DISAGGREGATED]))
    assert plan.terms.cost_s == pytest.approx(min(every))
    assert plan.terms.mode == IN_PLACE or (roles[plan.prefill.worker], roles[plan.worker]) == ("prefill", "decode")
