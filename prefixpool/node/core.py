"""One node's presence in the cluster, shared by our worker and the vLLM connector's pool.

    core = await NodeCore.open(blocks, arena, config, record)
        transfer server on config.transfer_url, serving any tier (through config.faults' source)
        record + the transfer URL peers reach   -> Membership (the node's lease) + Publisher, or with
                                                   index shards one of each per shard (meta/shards.py)
        exchange: fetch from peers, publish placement (node/exchange.py)
    found = await core.join()      SSD files from an earlier run indexed, then registered: the
                                   record and every block (those found included) under the lease
                                   (patient: etcd out of reach -> registered when it answers);
                                   finished SSD writes are collected and published every collect_s
    await core.leave()             nothing more is written; the lease is revoked: the record and
                                   every block key leave etcd at once (a drain's first step)
    await core.close()             collection stopped, left, servers and clients closed, tiers closed

The caller brings the blocks and arena (a device arena under an engine, or the
pool's host arena beside vLLM) and the record (what serves at its HTTP URL,
if anything); the core decides only the transfer URL. Every method runs on
one event loop. Knows nothing of engines, HTTP, vLLM or the router.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec

from prefixpool.meta.background import stop_task
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.meta.publisher import PublisherConfig
from prefixpool.meta.shards import node_index
from prefixpool.node.exchange import BlockExchange
from prefixpool.node.faults import Faults
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.transfer.address import parse_url
from prefixpool.transfer.fetcher import Fetcher
from prefixpool.transfer.server import Server, serve
from prefixpool.transfer.source import BlockSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    etcd_endpoints: str = "127.0.0.1:2379"
    etcd_shards: tuple[str, ...] = ()  # index shards' endpoints, shard 0 first (meta/shards.py); () = etcd_endpoints
    cluster: str = "default"  # the etcd namespace (Layout)
    transfer_url: str = "tcp://127.0.0.1:0"  # where the transfer server binds (port 0: a free one)
    advertise_host: str = ""  # the host peers are told (default: the one bound)
    token: str = ""  # shared transfer secret
    lease_ttl_s: int = 10
    publish_run_blocks: int = 1  # one etcd key per run of about this many blocks (meta/runs.py)
    collect_s: float = 0.2  # SSD writes finished -> published
    faults: Faults = Faults()


class NodeCore:
    def __init__(self, blocks: NodeBlocks, arena: KVArena, config: NodeConfig, source: BlockSource, server: Server,
                 record: NodeRecord) -> None:  # fmt: skip
        """Use `open`: the record names the server's port, so the server comes first."""
        self.blocks, self.arena, self.config = blocks, arena, config
        self.source, self.server = source, server
        self.fetcher = Fetcher(config.token)
        self.clients = [EtcdClient(endpoints) for endpoints in config.etcd_shards or (config.etcd_endpoints,)]
        self.etcd = self.clients[0]  # the home shard (the only one unless index shards are on)
        self.membership, self.publisher = node_index(self.clients, Layout(config.cluster), record, blocks.entries,
                                                     MembershipConfig(ttl_s=config.lease_ttl_s),
                                                     PublisherConfig(run_blocks=config.publish_run_blocks))
        self.exchange = BlockExchange(blocks, arena, self.publisher, self.fetcher)
        self._collect: asyncio.Task | None = None

    @classmethod
    async def open(cls, blocks: NodeBlocks, arena: KVArena, config: NodeConfig, record: NodeRecord) -> NodeCore:
        """Serve the blocks to peers; `record` is registered (by join) with the transfer URL they reach."""
        source = config.faults.source(blocks, arena)  # serves any tier
        server = await serve(blocks, arena, config.transfer_url, config.token, source=source)
        bound = parse_url(config.transfer_url)
        transfer_url = f"{bound.scheme}://{config.advertise_host or bound.host}:{parse_url(server.url).port}"
        return cls(blocks, arena, config, source, server, msgspec.structs.replace(record, transfer_url=transfer_url))

    @property
    def record(self) -> NodeRecord:
        return self.membership.record

    async def join(self, *, patient: bool = False) -> list[BlockKey]:
        """Register the node and its blocks under a fresh lease; the SSD blocks found from an earlier run.
        etcd out of reach raises EtcdError, or with `patient` registers in the background when it answers."""
        found = self.blocks.scan()  # before registering: registration publishes blocks.entries(), these included
        if found:
            log.info("node %s: %d valid SSD blocks from an earlier run", self.record.node_id, len(found))
        await self.publisher.start()  # before membership: registering hands it the lease
        await self.membership.start(patient=patient)
        self._collect = asyncio.create_task(self._collect_ssd(), name="ssd-collect")
        return found

    async def leave(self) -> None:
        """Stop publishing and revoke the lease: the record and every block key leave etcd now."""
        await self.publisher.stop()
        await self.membership.stop()

    async def close(self) -> None:
        await stop_task(self._collect)
        self._collect = None
        await self.leave()
        await self.server.close()
        await self.fetcher.close()
        for client in self.clients:
            await client.close()
        self.blocks.close()

    async def _collect_ssd(self) -> None:
        while True:
            await asyncio.sleep(self.config.collect_s)
            self.exchange.collect()
