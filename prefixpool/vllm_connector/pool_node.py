"""The pool beside one vLLM server: its blocks in host memory (and SSD), served to peers, published in etcd.

    save(keys, vllm_ids)           vLLM blocks not yet held -> fresh pool blocks -> commit -> publish
                                   (ssd_write_through: and queued for the SSD at once, not on eviction;
                                   fetched blocks go down on eviction only: the peer's SSD has them)
    prepare(keys, peer) -> Prepared
        promote   the SSD run after the host prefix comes up
        fetch     the rest from `peer` (a hint: it sends what it still has, each block checksummed)
        acquire   the longest prefix held here now, pinned until release(prepared)
    load(keys, first, vllm_ids, peer, may_copy)
        prepare, copy pool blocks [first, n) -> vLLM blocks (unless may_copy() says vLLM gave up), release;
        Loaded(n) says how many arrived intact (a layer-wise load copies a prepared hold itself)
    clear()                        every block nobody holds forgotten (arena and SSD) and deleted from etcd:
                                   vLLM's reset of the connector's cache (new weights make the KV stale)

    etcd: record "<node>.pool" (kind vllm-pool, its transfer URL) under a lease of its own,
          every block under that lease, in the tier that holds it (first tier = host-memory arena);
          with publish_run_blocks N > 1 run boundaries and tails only (meta/runs.py): a save is one
          request's chain, so its last key stored is the tail

The transfer server, the lease, publishing, fetching and SSD collection are the
node core's (prefixpool/node/core.py), the same our worker runs on; this module
adds what is the pool's own: copying between vLLM's blocks and the arena, and
write-through to the SSD. The lease is the pool's, not the sidecar's: the pool
lives in the vLLM process and its blocks die with it, while the sidecar's lease
follows vLLM's health and its prefix cache. Every method runs on one event loop
(LoopThread): the transfer server serves peers between vLLM's calls. Only a
layer-wise load reads the arena from another thread (the worker's copy thread),
and only blocks a Prepared hold pins. Knows nothing of vLLM's scheduler or of
the router.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from prefixpool.meta.membership import NodeRecord
from prefixpool.node.blocks import TierSizes, node_blocks
from prefixpool.node.core import NodeConfig, NodeCore
from prefixpool.node.exchange import BlockExchange
from prefixpool.node.faults import Faults
from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey, Namespace
from prefixpool.store.node_blocks import Hold
from prefixpool.vllm_connector.config import POOL_KIND, ConnectorConfig
from prefixpool.vllm_connector.paged_kv import PagedKV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    num_blocks: int  # keys[:num_blocks] are in vLLM's blocks now (those before `first` were already there)
    num_fetched: int
    num_bytes: int


@dataclass(frozen=True)
class Prepared:
    hold: Hold  # pool blocks of keys[:num_blocks], pinned until release()
    num_fetched: int
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.hold.block_ids)

    def num_new(self, first: int) -> int:
        """Blocks beyond the `first` vLLM already has."""
        return max(0, self.num_blocks - first)

    def loaded(self) -> Loaded:
        return Loaded(self.num_blocks, self.num_fetched, self.num_bytes)


def _tier_sizes(config: ConnectorConfig) -> TierSizes:
    """The SSD tier only (the arena is host memory already), in <disk_tier_dir>/<node_id>."""
    disk_dir = str(Path(config.disk_tier_dir) / config.node_id) if config.disk_tier_dir else ""
    return TierSizes(disk_blocks=config.disk_tier_blocks, disk_dir=disk_dir)


def _node_config(config: ConnectorConfig) -> NodeConfig:
    return NodeConfig(etcd_endpoints=config.etcd_endpoints, etcd_shards=config.shard_endpoints(),
                      cluster=config.cluster,
                      transfer_url=f"{config.transfer}://{config.host}:{config.transfer_port}",
                      advertise_host=config.advertise_host, token=config.token, lease_ttl_s=config.lease_ttl_s,
                      publish_run_blocks=config.publish_run_blocks, faults=Faults(fault_file=config.fault_file))


class PoolNode:
    def __init__(self, config: ConnectorConfig, paged: PagedKV, namespace: Namespace) -> None:
        self.config, self.paged, self.namespace = config, paged, namespace
        self.arena = KVArena(paged.arena_shape(config.pool_blocks), paged.dtype, "cpu")
        self.blocks = node_blocks(self.arena, _tier_sizes(config))
        self.write_through = self.blocks.tiers.disk if config.ssd_write_through else None
        self.core: NodeCore | None = None

    @property
    def started(self) -> NodeCore:
        assert self.core is not None, "start() first"
        return self.core

    @property
    def exchange(self) -> BlockExchange:
        return self.started.exchange

    async def start(self) -> None:
        namespace = self.namespace
        record = NodeRecord(self.config.pool_node_id(), "", "", namespace.block_size, self.config.pool_blocks,
                            namespace.model, kind=POOL_KIND, namespace=namespace.root().hex())
        self.core = await NodeCore.open(self.blocks, self.arena, _node_config(self.config), record)
        # patient: etcd too slow to answer while vLLM starts must not fail vLLM's engine (CI saw it on 2 cores)
        await self.core.join(patient=True)  # a warm SSD tier from an earlier run is published on registering
        log.info("prefixpool pool %s serving %s (%d blocks of %d bytes)", record.node_id,
                 self.core.record.transfer_url, self.config.pool_blocks, self.arena.block_bytes)

    async def stop(self) -> None:
        if self.core is not None:
            await self.core.close()  # revokes the lease: the pool's blocks leave etcd now
        else:
            self.blocks.close()

    async def save(self, keys: Sequence[BlockKey], vllm_ids: Sequence[int]) -> int:
        """Copy the blocks of `keys` this node does not hold yet out of vLLM; returns how many."""
        new = [(key, block) for key, block in zip(keys, vllm_ids) if self.blocks.tier_of(key) is None]
        if not new:
            return 0
        hold = self.blocks.acquire(())
        try:
            evicted = self.blocks.allocate(hold, min(len(new), self.blocks.num_free))
            new = new[: len(hold.block_ids)]
            self.paged.save([block for _, block in new], self.arena, hold.block_ids)
            stored = self.blocks.commit(hold, 0, [key for key, _ in new])
            if self.write_through is not None:
                self._write_through(stored)
        finally:
            self.blocks.release(hold)
        self.exchange.publish([*stored, *evicted])
        return len(stored)

    def _write_through(self, keys: Sequence[BlockKey]) -> None:
        """Queue the blocks just saved for the SSD tier (stored, and published, once collect() sees the files)."""
        for key in keys:
            block = self.arena.view(self.blocks.lookup(key)).reshape(-1).view(torch.uint8)
            self.write_through.put(key, block)

    async def prepare(self, keys: Sequence[BlockKey], peer_url: str) -> Prepared:
        """Hold the longest prefix of `keys` this pool can supply: local tiers, then fetched from `peer_url`."""
        self.blocks.promote(keys)
        held = len(self.blocks.match(keys))
        num_fetched = num_bytes = 0
        if held < len(keys) and peer_url:
            num_fetched, num_bytes = await self._fetch(peer_url, keys[held:])
        hold = self.blocks.acquire(keys)  # what is here now: local, fetched, and what a failed fetch committed
        self.exchange.publish_changes()
        return Prepared(hold, num_fetched, num_bytes)

    async def clear(self) -> int:
        """Forget every unheld block, in memory and on SSD, and delete them from etcd; returns how many."""
        keys = self.blocks.clear()
        self.exchange.publish(keys)
        await self.started.publisher.flush()
        return len(keys)

    def release(self, prepared: Prepared) -> None:
        self.blocks.release(prepared.hold)
        self.exchange.publish_changes()

    async def load(self, keys: Sequence[BlockKey], first: int, vllm_ids: Sequence[int], peer_url: str,
                   may_copy: Callable[[], bool]) -> Loaded:  # fmt: skip
        """Fill vllm_ids (the blocks of keys[first:]) with the longest intact prefix, if `may_copy()` still allows."""
        prepared = await self.prepare(keys, peer_url)
        try:
            if not may_copy():  # vLLM gave up on this load: its blocks are being recomputed
                return Loaded(first, prepared.num_fetched, prepared.num_bytes)
            self.paged.load(self.arena, prepared.hold.block_ids[first:], vllm_ids[: prepared.num_new(first)])
            return prepared.loaded()
        finally:
            self.release(prepared)

    async def _fetch(self, peer_url: str, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """(blocks, bytes) committed from the peer: a prefix of `keys`, cached (unheld) in this pool."""
        fetched = await self.exchange.fetch(peer_url, keys, self.config.fetch_timeout_s)
        if fetched.hold is not None:
            self.blocks.release(fetched.hold)  # cached, unheld: prepare() acquires the whole prefix at once
        return fetched.num_blocks, fetched.num_bytes
