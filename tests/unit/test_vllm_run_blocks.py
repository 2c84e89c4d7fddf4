"""Run-granular publication on the vLLM paths, without vLLM: the sidecar, `prefixpool up`, the connector's config.

The sidecar publishes what its ledger learns from KV events through a real Publisher (never started: publish()
only queues) set to the fleet's --publish-run-blocks; `up --publish-run-blocks N` hands N to every sidecar,
worker and router by flag and to every connector by kv_connector_extra_config.
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


def test_the_sidecar_publishes_boundaries_and_each_kv_events_tail():
    keys = chain(TOKENS, NS)
    ends = runs.boundaries(keys, RUN_BLOCKS)
    cut = next(i for i in range(30, 60) if i - 1 not in ends)  # the first request's tail is no boundary
    assert 99 not in ends
    node = sidecar(RUN_BLOCKS)
    assert node.publisher.config.run_blocks == RUN_BLOCKS
    node.stream = Events(BlockStored(list(range(cut)), None, TOKENS[:cut * B], B),  # a request's chain ...
                         BlockStored(list(range(cut, 100)), cut - 1, TOKENS[cut * B:], B))  # ... its next turn's
    asyncio.run(node._follow_events())
    expected = {keys[i] for i in ends} | {keys[cut - 1], keys[99]}
    assert set(node.publisher._pending) == expected and set(node.publisher._take()) == expected
    node.stream = Events(BlockRemoved(list(range(cut, 100))))  # evicted: only what was published is deleted
    asyncio.run(node._follow_events())
    assert node.publisher._pending == dict.fromkeys([keys[i] for i in ends if i >= cut] + [keys[99]])


def test_a_sidecar_left_at_one_publishes_every_block():
    node = sidecar(1)
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
