"""The router and vLLM connector pools: a pool takes no requests, its vLLM node can fetch from a peer pool.

Pure functions over node records (prefixpool/router/fleet.py, prefixpool/router/policy.py); the
records are the ones etcd holds (cluster/meta/membership.NodeRecord).
"""

from __future__ import annotations

import random

from prefixpool.meta.membership import NodeRecord
from prefixpool.vllm_connector.config import POOL_KIND as CONNECTOR_POOL_KIND
from prefixpool.router.cost_model import CostModel
from prefixpool.router.fleet import POOL_KIND, admit, pools_of, transfer_nodes, with_own_pools
from prefixpool.router.policy import NodeLoad, RouteRequest, policies
from prefixpool.store.keys import Namespace

NAMESPACE = Namespace(model="m", dtype="float32", block_size=32)
ROOT = NAMESPACE.root().hex()


def record(node_id: str, kind: str, namespace: str = ROOT) -> NodeRecord:
    url = "" if kind == POOL_KIND else f"http://{node_id}"
    return NodeRecord(node_id, url, f"tcp://{node_id}:1", 32, 64, "m", kind=kind, namespace=namespace)


NODES = {"a": record("a", "vllm"), "a.pool": record("a.pool", POOL_KIND), "b": record("b", "vllm"),
         "b.pool": record("b.pool", POOL_KIND), "c": record("c", "vllm"),
         "x.pool": record("x.pool", POOL_KIND, namespace="ff" * 16)}


def test_the_router_and_the_connector_spell_the_pool_kind_alike():
    assert POOL_KIND == CONNECTOR_POOL_KIND


def test_pools_take_no_requests_and_a_foreign_pool_is_no_source():
    candidates, refused = admit(NODES, NAMESPACE)
    assert set(candidates) == {"a", "b", "c"} and refused == {}
    assert set(pools_of(NODES, NAMESPACE)) == {"a.pool", "b.pool"}


def test_only_vllm_nodes_with_a_pool_and_the_pools_take_part_in_transfers():
    workers, pools = admit(NODES, NAMESPACE)[0], pools_of(NODES, NAMESPACE)
    assert transfer_nodes(workers, pools) == {"a", "b", "a.pool", "b.pool"}
    assert transfer_nodes(workers) == frozenset()  # vLLM nodes without pools: none
    ours = {"w1": record("w1", "prefixpool"), "w2": record("w2", "prefixpool")}
    assert transfer_nodes(ours) is None  # all our own workers: all of them


def test_a_vllm_node_counts_its_own_pool_and_the_plan_names_a_peer_pool():
    workers, pools = admit(NODES, NAMESPACE)[0], pools_of(NODES, NAMESPACE)
    matches = with_own_pools({"a": 2, "b.pool": 60, "a.pool": 5, "c": 1}, workers)
    assert (matches["a"], matches["b"], matches["c"]) == (5, 60, 1)  # b serves its own pool too
    costs = CostModel(block_size=32, block_bytes=32 * 16 * 1024, prefill_tokens_per_s=2000.0)
    busy = NodeLoad(queued_prefill_tokens=100_000)  # b is busy: fetching its prefix beats queueing on b
    loads = {"a": NodeLoad(), "b": busy, "c": NodeLoad()}
    request = RouteRequest(64 * 32, 64, {}, transfer_nodes(workers, pools))
    plan = policies()["cost"](request, matches, loads, costs, random.Random(0), explain=True)
    assert plan.worker == "a" and plan.fetch_from == "b.pool"
    assert (plan.fetch_start, plan.fetch_end) == (5, 60)
    assert all(t.fetch_from is None for t in plan.candidates if t.worker == "c")  # c has no pool
