"""The router's in-memory mirror of etcd: node records, the cluster-wide block index, and
every router's published in-flight load (prefixpool.meta.fleet_load).

    snapshot: range read of /prefixpool/<ns>/ at revision R -> index, nodes (built from scratch)
    watch:    from R+1, every event applied in order          -> gap-free by construction
    compacted / stream broken / etcd restarted (with or without data):
              fresh snapshot, rebuild from scratch, watch again

A node whose lease expires vanishes by itself: etcd deletes its keys and the
watch delivers the deletes. Keys or values under the prefix that are not ours
are skipped and counted, never a crash. etcd is the truth; this is a cache of
it. Knows nothing of HTTP, policies or how blocks are published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import msgspec

from prefixpool.meta.background import stop_task
from prefixpool.meta.etcd_client import EtcdClient, EtcdError, RevisionCompacted, Snapshot, Watch, WatchBatch
from prefixpool.meta.layout import BlockEntry, Layout
from prefixpool.meta.membership import NodeRecord, decode_record
from prefixpool.meta.fleet_load import FleetLoad, decode_load
from prefixpool.meta.index import BlockIndex
from prefixpool.meta import runs
from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import DEVICE

log = logging.getLogger(__name__)
MAX_TIER_BYTES = 32


@dataclass(frozen=True)
class MirrorConfig:
    retry_s: float = 0.5
    run_blocks: int = 1  # nodes publish one key per run of about this many blocks (prefixpool.meta.runs)

    def __post_init__(self) -> None:
        runs.check_run_blocks(self.run_blocks)


class Mirror:
    def __init__(self, client: EtcdClient, layout: Layout, config: MirrorConfig = MirrorConfig()) -> None:
        self.client, self.layout, self.config = client, layout, config
        self.index = BlockIndex()
        self.nodes: dict[str, NodeRecord] = {}
        self.node_revisions: dict[str, int] = {}  # node -> etcd revision of its record (its latest load report)
        self.fleet = FleetLoad()
        self.revision = 0  # everything up to this etcd revision is applied
        self.num_resyncs = self.num_events = self.num_skipped = 0
        self.applied_at = 0.0  # time.monotonic() of the latest applied batch
        self.connected = False  # a snapshot loaded and no etcd error since (index shards ignore a shard without)
        self._watch: Watch | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start syncing in the background; use wait_revision to wait for a known write."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def num_keys(self) -> int:
        return len(self.index)

    def lag_s(self) -> float:
        """Seconds since the mirror last applied anything from etcd (0 before the first snapshot)."""
        return time.monotonic() - self.applied_at if self.applied_at else 0.0

    def workers(self) -> dict[str, NodeRecord]:
        """Live nodes by id (the router's ClusterView)."""
        return self.nodes

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Per node, how many blocks from keys[0] on it holds consecutively (at run granularity: runs.py)."""
        return runs.longest_prefix(self.index, keys, self.config.run_blocks)

    def held_blocks(self, node_id: str) -> int:
        """How many blocks the index names on `node_id`: its cache's occupied part, as its events tell it."""
        return self.index.num_blocks(node_id)

    def report_revision(self, node_id: str) -> int:
        """etcd revision of the node's latest record, the load it reports included (0 if unknown)."""
        return self.node_revisions.get(node_id, 0)

    def fleet_routed(self, keys: Sequence[BlockKey], exclude: str) -> dict[str, int]:
        """Per node, keys[0..n) that routers other than `exclude` just sent there (their speculative entries)."""
        return self.fleet.routed(keys, exclude)

    def fleet_share(self, worker: str, exclude: str) -> tuple[int, int]:
        """(requests, queued prefill tokens) that routers other than `exclude` have in flight on `worker`."""
        return self.fleet.share(worker, exclude)

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        """{tier: blocks} of `keys` the node holds below the device; with runs, a run counts in its boundary's tier."""
        if self.config.run_blocks == 1:
            return self.index.lower_tiers(node_id, keys)
        lengths = runs.run_lengths(list(keys), self.config.run_blocks)
        counts: dict[str, int] = {}
        if not self.index.lower_tiers(node_id, lengths):
            return counts
        for key, length in lengths.items():
            tier = self.index.tier_of(node_id, key)
            if tier is not None and tier != DEVICE:
                counts[tier] = counts.get(tier, 0) + length
        return counts

    async def wait_revision(self, revision: int, timeout_s: float = 10.0) -> None:
        """Until the mirror has applied everything up to `revision`, which must be the revision of a
        write under the prefix (what Publisher.flush returns): etcd 3.5.1's progress notifications
        cannot be trusted (etcd#15220), so an idle mirror only learns revisions from events."""
        async with asyncio.timeout(timeout_s):
            while self.revision < revision:
                await asyncio.sleep(0.005)

    async def _run(self) -> None:
        while True:
            try:
                snapshot = await self.client.get_prefix(self.layout.prefix)
                self._load(snapshot)
                self._watch = await self.client.watch_prefix(self.layout.prefix, snapshot.revision + 1)
                async for batch in self._watch:
                    self._apply(batch)
            except RevisionCompacted as error:
                log.warning("mirror: %s; taking a fresh snapshot", error)
            except EtcdError as error:
                self._lose()
                log.warning("mirror: etcd: %s; resync in %.1fs", error, self.config.retry_s)
                await asyncio.sleep(self.config.retry_s)
            finally:
                if self._watch is not None:
                    self._watch.cancel()
                    self._watch = None

    def _clear_index(self) -> None:
        """Before a snapshot: the index starts from nothing (a shard's mirror forgets only its shard's blocks)."""
        self.index = BlockIndex()

    def _lose(self) -> None:
        """etcd stopped answering: the index stays as it was until a fresh snapshot (one etcd: stale beats
        empty; a shard's mirror forgets its blocks instead: prefixpool.meta.sharded_mirror)."""
        self.connected = False

    def _parse_block(self, key: bytes) -> BlockEntry | None:
        """The block entry `key` names, if it is one of this mirror's (a shard's: of that shard)."""
        return self.layout.parse_block(key)

    def _load(self, snapshot: Snapshot) -> None:
        self._clear_index()
        self.nodes, self.node_revisions, self.fleet = {}, {}, FleetLoad()
        blocks: dict[tuple[str, str], list[BlockKey]] = {}  # a snapshot holds each (key, node) once: any order
        for kv in snapshot.kvs:
            entry = self._parse_block(kv.key)
            if entry is not None and (tier := self._tier(kv.value)) is not None:
                blocks.setdefault((entry.node_id, tier), []).append(entry.key)
            else:
                self._put(kv.key, kv.value, kv.mod_revision)
        for (node_id, tier), keys in blocks.items():  # one index call per node and tier
            self.index.add(node_id, keys, tier)
        self.revision = snapshot.revision
        self.connected = True
        self.num_resyncs += 1
        self.applied_at = time.monotonic()
        log.info("mirror: snapshot at revision %d: %d nodes, %d blocks", snapshot.revision, len(self.nodes),
                 len(self.index))  # fmt: skip

    def _apply(self, batch: WatchBatch) -> None:
        """Events in order; consecutive block events of one node and one kind (add in a tier, remove) go to
        the index in one call: the same result as one by one, at the index's batch speed (a publisher's txn
        arrives as one watch batch of such runs)."""
        group: tuple[str, str | None] | None = None  # (node, tier to add in | None to remove)
        keys: list[BlockKey] = []
        for event in batch.events:
            entry = self._parse_block(event.key)
            tier = self._tier(event.value) if event.is_put and entry is not None else None
            if entry is None or (event.is_put and tier is None):  # not a block, or malformed: one by one
                self._flush(group, keys)
                group, keys = None, []
                if event.is_put:
                    self._put(event.key, event.value, event.revision)
                else:
                    self._delete(event.key)
                continue
            kind = (entry.node_id, tier)
            if kind != group:
                self._flush(group, keys)
                group, keys = kind, []
            keys.append(entry.key)
        self._flush(group, keys)
        self.num_events += len(batch.events)
        self.revision = max(self.revision, batch.revision)
        self.applied_at = time.monotonic()

    def _flush(self, group: tuple[str, str | None] | None, keys: list[BlockKey]) -> None:
        if group is None or not keys:
            return
        node_id, tier = group
        keys = list(dict.fromkeys(keys))  # a key twice in one run: the same op twice
        if tier is not None:
            self.index.add(node_id, keys, tier)
        else:
            self.index.remove(node_id, keys)

    def _put(self, key: bytes, value: bytes, revision: int) -> None:
        """A malformed value replacing a good one removes the good one: the mirror never holds more than etcd."""
        if (entry := self._parse_block(key)) is not None:
            tier = self._tier(value)
            if tier is not None:
                self.index.add(entry.node_id, [entry.key], tier)
                return
            self._delete(key)
        elif (node_id := self.layout.parse_node(key)) is not None:
            record = self._record(value)
            if record is not None and record.node_id == node_id:
                self.nodes[node_id] = record
                self.node_revisions[node_id] = revision
                return
            self.nodes.pop(node_id, None)
        elif (router_id := self.layout.parse_router(key)) is not None:
            load = self._router_load(value)
            if load is not None and load.router_id == router_id:
                self.fleet.put(load, revision)
                return
            self.fleet.delete(router_id)
        self._skip(key, value)

    @staticmethod
    def _record(value: bytes) -> NodeRecord | None:
        try:
            return decode_record(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    @staticmethod
    def _router_load(value: bytes):
        try:
            return decode_load(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None

    def _delete(self, key: bytes) -> None:
        if (entry := self._parse_block(key)) is not None:
            self.index.remove(entry.node_id, [entry.key])  # a node left holding nothing is forgotten
        elif (node_id := self.layout.parse_node(key)) is not None:
            self.nodes.pop(node_id, None)
            self.node_revisions.pop(node_id, None)
        elif (router_id := self.layout.parse_router(key)) is not None:
            self.fleet.delete(router_id)
        else:
            self._skip(key, b"")

    @staticmethod
    def _tier(value: bytes) -> str | None:
        if not value or len(value) > MAX_TIER_BYTES or not value.isascii() or not value.decode().isidentifier():
            return None
        return value.decode()

    def _skip(self, key: bytes, value: bytes) -> None:
        self.num_skipped += 1
        log.warning("mirror: skipping foreign or malformed entry %r = %r", key[:200], value[:100])
