"""`prefixpool vllm-node`: the sidecar that makes one vLLM server a node of the cluster.

    vLLM /v1/models  -> the served name must be --model (it enters the block-key namespace)
    VllmNode         -> record kind "vllm" under a lease, blocks from KV events (prefixpool/vllm_sidecar/node.py),
                        published per run of --publish-run-blocks N as the fleet's workers do (meta/runs.py)
    READY <vllm url> once registered

SIGTERM or SIGINT revokes the lease: the node's blocks leave every router's index at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from prefixpool.deploy.processes import announce_ready, start_logging
from prefixpool.deploy.settings import add_flags, from_args
from prefixpool.deploy.vllm_node_settings import VllmNodeSettings
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.meta.publisher import PublisherConfig
from prefixpool.vllm_sidecar.event_stream import EventStream, StreamConfig
from prefixpool.vllm_sidecar.node import KIND, HealthConfig, VllmNode
from prefixpool.store.keys import Namespace

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")  # NodeRecord.role


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, VllmNodeSettings)


def run(args: argparse.Namespace) -> int:
    start_logging()
    asyncio.run(serve(from_args(VllmNodeSettings, args)))
    return 0


def namespace_of(settings: VllmNodeSettings) -> Namespace:
    """What the router hashes under for the same --model, --dtype and --block-size (model_config.namespace_for)."""
    return Namespace(model=settings.model, dtype=settings.dtype, block_size=settings.block_size)


def build_node(settings: VllmNodeSettings, etcd: EtcdClient | list[EtcdClient]) -> VllmNode:
    if settings.role not in ROLES:
        raise SystemExit(f"--role {settings.role!r}: choose from {', '.join(ROLES)}")
    namespace = namespace_of(settings)
    node_id = settings.node_id or f"vllm-{socket.gethostname()}-{os.getpid()}"
    record = NodeRecord(node_id, settings.vllm_url.rstrip("/"), "", settings.block_size, 0, settings.model,
                        kind=KIND, namespace=namespace.root().hex(), role=settings.role)
    stream = EventStream(StreamConfig(settings.kv_events, settings.replay_endpoint, settings.kv_topic))
    return VllmNode(etcd, Layout(settings.cluster), record, namespace, stream,
                    MembershipConfig(ttl_s=settings.lease_ttl_s),
                    HealthConfig(settings.health_period_s, settings.health_failures),
                    PublisherConfig(run_blocks=settings.publish_run_blocks), settings.tail_delay_s)


async def serve(settings: VllmNodeSettings) -> None:
    clients = [EtcdClient(endpoints) for endpoints in settings.shard_endpoints]  # index shards, shard 0 first
    node = build_node(settings, clients)
    task = asyncio.create_task(node.run())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registered = asyncio.create_task(node.registered.wait())
    await asyncio.wait([task, registered], return_when=asyncio.FIRST_COMPLETED)
    if registered.done():
        announce_ready(node.vllm_url)
        await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    error = task.exception() if task.done() else None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    node.stream.close()
    for client in clients:
        await client.close()
    if error is not None:
        raise SystemExit(f"vllm-node stopped: {error}")
