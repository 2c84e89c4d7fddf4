"""Run-granular publication on the vLLM paths, without vLLM: the sidecar, `prefixpool up`, the connector's config.

The sidecar publishes what its ledger learns from KV events through a real Publisher (never started: publish()
only queues) set to the fleet's --publish-run-blocks, a chain's tail once it stops growing (a hand-moved clock);
`up --publish-run-blocks N` hands N to every sidecar, worker and router by flag and to every connector by
kv_connector_extra_config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

import pytest

from prefixpool.deploy import launcher
from prefixpool.deploy.launcher import LocalCluster, run_blocks_of
from prefixpool.deploy.vllm_fleet import vllm_config
from prefixpool.deploy.vllm_node_cli import build_node
from prefixpool.deploy.vllm_node_settings import VllmNodeSettings
from prefixpool.meta import runs
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.store.keys import Namespace, chain
from prefixpool.vllm_connector.config import BadConnectorConfig, config_from
from prefixpool.vllm_sidecar.events import BlockRemoved, BlockStored, EventBatch
from prefixpool.vllm_sidecar.ledger import Change
from prefixpool.vllm_sidecar.tails import PendingTails

B = 4
RUN_BLOCKS = 8
NS = Namespace(model="m", dtype="float32", block_size=B)
TOKENS = list(range(1, 401))  # 100 blocks


class Events:
    """The sidecar's event stream: one batch of the given events, then the end."""

    def __init__(self, *events) -> None:
        self.events = list(events)

    async def batches(self):
        yield 0, EventBatch(0.0, self.events)


def sidecar(run_blocks: int):
    settings = VllmNodeSettings(model="m", dtype="float32", block_size=B, publish_run_blocks=run_blocks,
                                node_id="vllm-0")
    node = build_node(settings, [EtcdClient("127.0.0.1:1")])
    node.stream.close()
    return node


class Clock:
    """The pending tails' clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sidecar_at(run_blocks: int, clock: Clock):
    node = sidecar(run_blocks)
    node.tails.clock = clock
    return node


def follow(node, *events) -> None:
    node.stream = Events(*events)
    asyncio.run(node._follow_events())


def after(node, clock: Clock, seconds: float) -> None:
    """`seconds` later, the periodic check of pending tails."""
    clock.now += seconds
    node._publish_tails()


def decode_blocks(first: int, last: int) -> list[BlockStored]:
    """One BlockStored per generated block that fills, as vLLM sends them: blocks first..last-1 of TOKENS."""
    return [BlockStored([i], i - 1, TOKENS[i * B:(i + 1) * B], B) for i in range(first, last)]


def test_the_sidecar_publishes_boundaries_at_once_and_a_chains_tail_once_it_stops_growing():
    keys = chain(TOKENS, NS)
    ends = runs.boundaries(keys, RUN_BLOCKS)
    assert 99 not in ends and 29 not in ends
    clock = Clock()
    node = sidecar_at(RUN_BLOCKS, clock)
    assert node.publisher.config.run_blocks == RUN_BLOCKS and node.tails.delay_s == 1.0  # --tail-delay-s
    follow(node, BlockStored(list(range(30)), None, TOKENS[:120], B),  # prefill, two chunks ...
           BlockStored(list(range(30, 60)), 29, TOKENS[120:240], B), *decode_blocks(60, 100))  # ... then decode
    boundary_keys = {keys[i] for i in ends}
    assert set(node.publisher._pending) == boundary_keys and len(node.tails) == 1
    after(node, clock, 0.5)
    assert set(node.publisher._pending) == boundary_keys
    after(node, clock, 0.5)  # tail_delay_s (1 s) since the chain last grew: its last key, once
    assert set(node.publisher._take()) == boundary_keys | {keys[99]} and len(node.tails) == 0
    after(node, clock, 5.0)
    assert not node.publisher._pending
    follow(node, BlockRemoved(list(range(50, 100))))  # evicted: only what was published is deleted
    assert node.publisher._pending == dict.fromkeys([keys[i] for i in ends if i >= 50] + [keys[99]])


def test_a_chain_whose_pending_tail_is_evicted_publishes_no_tail():
    keys = chain(TOKENS[:120], NS)
    assert runs.boundaries(keys, RUN_BLOCKS)[-1] < 28
    clock = Clock()
    node = sidecar_at(RUN_BLOCKS, clock)
    follow(node, BlockStored(list(range(30)), None, TOKENS[:120], B))
    after(node, clock, 0.5)
    follow(node, BlockRemoved([29]))  # the tail goes before the chain is taken as ended
    after(node, clock, 5.0)
    assert set(node.publisher._pending) == {keys[i] for i in runs.boundaries(keys, RUN_BLOCKS)}


def test_two_chains_each_get_their_own_tail():
    other = [t + 1000 for t in TOKENS[80:160]]  # a second request shares blocks 0..19, then goes its own way
    keys, forked = chain(TOKENS[:152], NS), chain(TOKENS[:80] + other, NS)
    assert not {keys[37], forked[39]} & {k for k in keys + forked if runs.is_boundary(k, RUN_BLOCKS)}
    clock = Clock()
    node = sidecar_at(RUN_BLOCKS, clock)
    follow(node, BlockStored(list(range(30)), None, TOKENS[:120], B),
           BlockStored(list(range(1000, 1020)), 19, other, B),  # continues block 19: no pending tail
           BlockStored(list(range(30, 38)), 29, TOKENS[120:152], B))
    after(node, clock, 1.0)
    tails = set(node.publisher._pending) - {k for k in keys + forked if runs.is_boundary(k, RUN_BLOCKS)}
    assert tails == {keys[37], forked[39]}


def test_pending_tails_beyond_their_bound_are_due_oldest_first():
    clock = Clock()
    tails = PendingTails(1.0, max_pending=2, clock=clock)
    for key in (b"a", b"b", b"c"):
        tails.follow(Change(parent=b"root", last=key))
        clock.now += 0.1
    assert tails.due() == [b"a"] and len(tails) == 2
    tails.follow(Change(parent=b"b", last=b"d"))  # b's chain went on
    clock.now += 1.0
    assert tails.due() == [b"c", b"d"]


def test_a_sidecar_left_at_one_publishes_every_block():
    node = sidecar(1)
    assert node.tails is None
    node.stream = Events(BlockStored(list(range(10)), None, TOKENS[:40], B))
    asyncio.run(node._follow_events())
    assert list(node.publisher._pending) == chain(TOKENS[:40], NS)


@dataclass
class Etcd:  # what LocalCluster reads of its etcd before it starts servers
    endpoint: str = "127.0.0.1:2379"


@dataclass
class Server:  # what start_sidecar reads of a vLLM server
    url: str = "http://127.0.0.1:8000"
    events: str = "tcp://127.0.0.1:5557"
    replay: str = "tcp://127.0.0.1:5558"


def up_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(["--vllm", "1", "--model-path", "/m", *flags])


def test_up_hands_publish_run_blocks_to_sidecars_workers_routers_and_connectors(monkeypatch):
    spawned = {}
    monkeypatch.setattr(launcher, "spawn", lambda name, argv, *_: spawned.setdefault(name, argv))
    args = up_args("--publish-run-blocks", "8", "--vllm-connector")
    cluster = LocalCluster(num_workers=0, vllm=vllm_config(args), num_vllm=1, vllm_connector=True,
                           publish_run_blocks=run_blocks_of(args), etcd=Etcd(), vllm_servers={"vllm-0": Server()})
    cluster.start_sidecar("vllm-0")
    cluster.start_worker("worker-0")
    cluster.start_router("router")
    for argv in spawned.values():
        assert argv[argv.index("--publish-run-blocks") + 1] == "8"
    extra = json.loads(cluster.vllm_config_for("vllm-0").kv_transfer_config)["kv_connector_extra_config"]
    assert config_from(extra).publish_run_blocks == 8


def test_up_publishes_per_block_unless_told_and_reads_the_environment():
    assert run_blocks_of(up_args(), {}) == 1
    assert run_blocks_of(up_args(), {"PREFIXPOOL_PUBLISH_RUN_BLOCKS": "32"}) == 32
    assert run_blocks_of(up_args("--publish-run-blocks", "4"), {"PREFIXPOOL_PUBLISH_RUN_BLOCKS": "32"}) == 4
    with pytest.raises(SystemExit, match="power of two"):
        run_blocks_of(up_args("--publish-run-blocks", "12"), {})
    cluster = LocalCluster(num_workers=0, etcd=Etcd())
    assert "--publish-run-blocks" not in cluster._common()


def test_the_connectors_pool_publishes_with_its_configs_run_blocks():
    from prefixpool.vllm_connector.pool_node import _node_config

    assert _node_config(config_from({"publish_run_blocks": 16})).publish_run_blocks == 16
    assert _node_config(config_from({})).publish_run_blocks == 1
    with pytest.raises(BadConnectorConfig, match="publish_run_blocks"):
        config_from({"publish_run_blocks": 3})
