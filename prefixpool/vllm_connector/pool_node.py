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
          every block under that lease, in the tier that holds it (first tier = host-memory arena)

The lease is the pool's, not the sidecar's: the pool lives in the vLLM
process and its blocks die with it, while the sidecar's lease follows vLLM's
health and its prefix cache. Every method runs on one event loop (LoopThread):
the transfer server serves peers between vLLM's calls. Only a layer-wise load
reads the arena from another thread (the worker's copy thread), and only blocks
a Prepared hold pins. Knows nothing of vLLM's scheduler or of the router.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import Membership, MembershipConfig, NodeRecord
from prefixpool.meta.publisher import Publisher, publish_placement
from prefixpool.vllm_connector.config import POOL_KIND, ConnectorConfig
from prefixpool.vllm_connector.paged_kv import PagedKV
from prefixpool.vllm_connector.pool_faults import pool_source
from prefixpool.store.arena import KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.keys import BlockKey, Namespace
from prefixpool.store.node_blocks import Hold, NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import TierChain
from prefixpool.transfer.errors import TransferError
from prefixpool.transfer.fetcher import Fetcher
from prefixpool.transfer.server import Server, serve

log = logging.getLogger(__name__)
COLLECT_S = 0.2  # SSD writes finished -> published


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


def _disk(config: ConnectorConfig, arena: KVArena) -> DiskTier | None:
    if config.disk_tier_blocks <= 0:
        return None
    if not config.disk_tier_dir:
        raise ValueError("disk_tier_blocks needs disk_tier_dir")
    return DiskTier(Path(config.disk_tier_dir) / config.node_id, arena.block_bytes, config.disk_tier_blocks)


class PoolNode:
    def __init__(self, config: ConnectorConfig, paged: PagedKV, namespace: Namespace) -> None:
        self.config, self.paged, self.namespace = config, paged, namespace
        self.arena = KVArena(paged.arena_shape(config.pool_blocks), paged.dtype, "cpu")
        disk = _disk(config, self.arena)
        tiers = TierChain(self.arena, disk=disk) if disk is not None else None  # not `if disk`: an empty tier is falsy
        self.blocks = NodeBlocks(BlockPool(config.pool_blocks), tiers)
        self.write_through = disk if config.ssd_write_through else None
        self.source = pool_source(self.blocks, self.arena, config.fault_file)
        self.fetcher = Fetcher(config.token)
        self.server: Server | None = None
        self.etcd: EtcdClient | None = None
        self.membership: Membership | None = None
        self.publisher: Publisher | None = None
        self._collect: asyncio.Task | None = None

    async def start(self) -> None:
        config = self.config
        self.server = await serve(self.blocks, self.arena, f"{config.transfer}://{config.host}:{config.transfer_port}",
                                  config.token, source=self.source)
        port = self.server.url.rsplit(":", 1)[1]
        transfer_url = f"{config.transfer}://{config.advertise_host or config.host}:{port}"
        record = NodeRecord(config.pool_node_id(), "", transfer_url, self.namespace.block_size, config.pool_blocks,
                            self.namespace.model, kind=POOL_KIND, namespace=self.namespace.root().hex())
        self.etcd = EtcdClient(config.etcd_endpoints)
        self.membership = Membership(self.etcd, Layout(config.cluster), record, MembershipConfig(ttl_s=config.lease_ttl_s))
        self.publisher = Publisher(self.etcd, self.membership, self.blocks.entries)
        found = self.blocks.scan()  # a warm SSD tier from an earlier run: published on registering
        await self.publisher.start()
        await self.membership.start()
        self._collect = asyncio.create_task(self._collect_ssd())
        log.info("prefixpool pool %s serving %s (%d blocks of %d bytes, %d from SSD)", record.node_id,
                 transfer_url, config.pool_blocks, self.arena.block_bytes, len(found))

    async def stop(self) -> None:
        if self._collect is not None:
            self._collect.cancel()
        if self.publisher is not None:
            await self.publisher.stop()
            await self.membership.stop()  # revokes the lease: the pool's blocks leave etcd now
            await self.server.close()
            await self.etcd.close()
        await self.fetcher.close()
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
        self._publish([*stored, *evicted])
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
        self._publish(self.blocks.take_changes().keys())
        return Prepared(hold, num_fetched, num_bytes)

    async def clear(self) -> int:
        """Forget every unheld block, in memory and on SSD, and delete them from etcd; returns how many."""
        keys = self.blocks.clear()
        self._publish(keys)
        await self.publisher.flush()
        return len(keys)

    def release(self, prepared: Prepared) -> None:
        self.blocks.release(prepared.hold)
        self._publish(self.blocks.take_changes().keys())

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
        try:
            result = await self.fetcher.fetch(peer_url, keys, self.blocks, self.arena,
                                              deadline_s=self.config.fetch_timeout_s)
        except TransferError as err:
            log.warning("fetch of %d blocks from %s failed (%s): %d arrived intact", len(keys), peer_url,
                        err, len(err.stored))
            self._publish([*err.stored, *err.evicted])
            return len(err.stored), len(err.stored) * self.arena.block_bytes
        num_blocks = result.num_blocks
        if num_blocks < len(keys):
            log.warning("fetch from %s: %d of %d blocks arrived intact", peer_url, num_blocks, len(keys))
        self.blocks.release(result.hold)  # cached, unheld: load() acquires the whole prefix at once
        self._publish([*result.keys, *result.evicted])
        return num_blocks, result.num_bytes

    def _publish(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            publish_placement(self.publisher, self.blocks.placement(keys))

    async def _collect_ssd(self) -> None:
        while True:
            await asyncio.sleep(COLLECT_S)
            self.blocks.collect()
            self._publish(self.blocks.take_changes().keys())
