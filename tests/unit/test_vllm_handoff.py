"""The prefill-to-decode handoff's kv_transfer_params (prefixpool/vllm_connector/handoff.py): what a prefill server
answers round-trips, and anything else a client may send in kv_transfer_params is no handoff (the request computes)."""

from __future__ import annotations

import json

import pytest

from prefixpool.vllm_connector.handoff import Handoff, asks_for_handoff, handoff_of, prefill_params


def test_a_prefill_servers_answer_round_trips_through_json():
    handoff = Handoff("vllm-prefill-0.pool", 12)
    assert handoff_of(json.loads(json.dumps(handoff.params()))) == handoff


@pytest.mark.parametrize("params", [None, [], "x", {}, {"prefixpool_pool": "p.pool"},
                                    {"prefixpool_pool": "", "prefixpool_num_blocks": 3},
                                    {"prefixpool_pool": "p.pool", "prefixpool_num_blocks": 0},
                                    {"prefixpool_pool": "p.pool", "prefixpool_num_blocks": -2},
                                    {"prefixpool_pool": "p.pool", "prefixpool_num_blocks": "3"},
                                    {"prefixpool_pool": "p.pool", "prefixpool_num_blocks": True},
                                    {"prefixpool_pool": 7, "prefixpool_num_blocks": 3}])
def test_anything_else_is_no_handoff(params):
    assert handoff_of(params) is None


def test_only_vllms_own_key_asks_for_a_handoff():
    assert asks_for_handoff(prefill_params())
    assert not asks_for_handoff(None) and not asks_for_handoff({"do_remote_decode": "yes"})
    assert not asks_for_handoff(Handoff("p.pool", 1).params())
