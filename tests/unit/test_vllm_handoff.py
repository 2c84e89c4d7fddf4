"""vLLM prefill/decode: the handoff's kv_transfer_params (prefixpool/vllm_connector/handoff.py) - what a prefill
server answers round-trips, anything else a client may send is no handoff (the request computes) - and the roles a
disaggregated fleet gives its servers (connector kv_role) and sidecars (node record role)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from prefixpool.deploy.vllm_fleet import (add_vllm_arguments, num_vllm_servers, on_node, roles_of, sidecar_args,
                                          vllm_config)
from prefixpool.deploy.vllm_server import VllmServer
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


def test_a_disaggregated_vllm_fleet_gives_each_server_its_connector_role_and_its_sidecar_the_nodes():
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)  # `prefixpool up` and `prefixpool ray up`
    args = parser.parse_args(["--vllm-prefill", "1", "--vllm-decode", "2", "--vllm-connector", "--model-path", "/m"])
    assert num_vllm_servers(args) == 3
    roles = roles_of(args.vllm, args.vllm_prefill, args.vllm_decode)
    assert roles == {"vllm-prefill-0": "prefill", "vllm-decode-0": "decode", "vllm-decode-1": "decode"}
    config = vllm_config(args)
    kv_roles = {node_id: json.loads(on_node(config, node_id, "127.0.0.1:2379", True, role=role).kv_transfer_config)
                for node_id, role in roles.items()}
    assert {n: c["kv_role"] for n, c in kv_roles.items()} == {"vllm-prefill-0": "kv_producer",
                                                               "vllm-decode-0": "kv_consumer",
                                                               "vllm-decode-1": "kv_consumer"}
    assert kv_roles["vllm-decode-1"]["kv_connector_extra_config"]["node_id"] == "vllm-decode-1"
    server = VllmServer(None, "http://127.0.0.1:1", "ipc://e", "ipc://r", Path("/dev/null"))
    argv = sidecar_args("vllm-decode-0", server, "127.0.0.1:2379", config, role="decode")
    assert argv[argv.index("--role") + 1] == "decode"
    with pytest.raises(SystemExit, match="need --vllm-connector"):
        vllm_config(parser.parse_args(["--vllm-prefill", "1", "--vllm-decode", "1", "--model-path", "/m"]))
