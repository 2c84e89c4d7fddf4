"""Block publication: what the node stores and evicts, into etcd, off the caller's path.

    publish(stored, removed)          caller (forward pass), never waits on etcd
        │  run filter when run_blocks > 1 (prefixpool.meta.runs): run boundaries, each stored chain's
        │    tail (`tails`, else stored's last key), and keys etcd holds (a tail moved to another tier, or evicted)
        │  pending: {key: tier | None}   one entry per key, the latest op wins
        │  coalesced: an op that leaves the key as etcd will hold it is no op at all
        │    (store then remove of a key etcd never had -> nothing; remove then store
        │     of a key etcd has in that tier -> nothing; store then remove of a key
        │     etcd has -> one delete). `written` is etcd's state after every write
        │     taken so far; a key whose write failed is uncertain and never coalesced.
        ▼  window_s: wait this long after the first op, so more of them meet in one batch
    background task: up to max_batch ops -> txns of <= the client's max_txn_ops under the node lease
        EtcdUnavailable  -> put the batch back (newer ops win), retry later
        LeaseNotFound    -> membership rotates, which re-publishes everything
    overflow (more than max_pending keys waiting):
        drop the queue, ignore publishes, schedule a full re-publish: a lease
        rotation that re-puts all_keys() under a new lease and revokes the old
        one, which deletes exactly the keys evicted while nothing was written.

Knows nothing of the block pool (it gets `all_keys`) or of the router.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping, Protocol

from prefixpool.meta.background import stop_task
from prefixpool.meta.etcd_client import EtcdClient, EtcdError, LeaseNotFound
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import Membership
from prefixpool.meta.runs import check_run_blocks, published, published_entries
from prefixpool.store.tier_names import DEVICE
from prefixpool.store.keys import BlockKey

log = logging.getLogger(__name__)

AllKeys = Callable[[], list[tuple[BlockKey, str]]]


class PublishesBlocks(Protocol):
    def publish(self, stored: Iterable[BlockKey] = ..., removed: Iterable[BlockKey] = ..., tier: str = ...,
                tails: Collection[BlockKey] | None = ...) -> None: ...


def publish_placement(publisher: PublishesBlocks, placement: tuple[Mapping[str, list[BlockKey]], list[BlockKey]],
                      tails: Collection[BlockKey] | None = None) -> None:
    """Each key in the tier that holds it now, or deleted where none does (NodeBlocks.placement's answer);
    `tails` as Publisher.publish takes them (None: each tier's last stored key)."""
    stored, removed = placement
    if removed:
        publisher.publish(removed=removed)
    for tier, tier_keys in stored.items():
        publisher.publish(stored=tier_keys, tier=tier, tails=tails)


@dataclass(frozen=True)
class PublisherConfig:
    max_pending: int = 65_536
    max_batch: int = 2048
    retry_s: float = 0.5
    window_s: float = 0.0  # wait after the first op before writing, so more ops coalesce and batch (0: at once)
    run_blocks: int = 1  # publish one key per run of about this many blocks (prefixpool.meta.runs); 1: every block

    def __post_init__(self) -> None:
        check_run_blocks(self.run_blocks)


class Publisher:
    def __init__(self, client: EtcdClient, membership: Membership, all_keys: AllKeys,
                 config: PublisherConfig = PublisherConfig()) -> None:  # fmt: skip
        self.client, self.membership, self.all_keys, self.config = client, membership, all_keys, config
        self.layout: Layout = membership.layout
        self.node_id = membership.record.node_id
        self.revision = 0  # etcd revision after our latest write
        self.num_written = self.num_dropped = self.num_overflows = self.num_coalesced = 0
        self._pending: dict[BlockKey, str | None] = {}
        self._written: dict[BlockKey, str] = {}  # etcd's state once every batch taken so far is written
        self._uncertain: set[BlockKey] = set()  # keys of a failed write: etcd may or may not have applied it
        self._mutex = threading.Lock()  # publish() may be called from a worker thread
        self._republish = False
        self._writing = self._filling = self._rotating = False
        self._generation = self._batch_generation = 0  # +1 per fill: a batch taken before it is stale
        self._lease_seen = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        membership.on_rotate = self._fill

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    def publish(self, stored: Iterable[BlockKey] = (), removed: Iterable[BlockKey] = (), tier: str = DEVICE,
                tails: Collection[BlockKey] | None = None) -> None:
        """Non-blocking, thread-safe. Later ops on the same key replace earlier pending ones. `stored` in chain
        order; `tails`: the stored chains' last keys (None: stored's last), published with the run boundaries."""
        stored = list(stored)
        tails = stored[-1:] if tails is None else tails
        with self._mutex:
            stored = published(stored, self.config.run_blocks, tails, self._etcd_holds)
            removed = published(removed, self.config.run_blocks, (), self._etcd_holds)
            if self._republish:
                self.num_dropped += len(stored) + len(removed)
            else:
                self._enqueue(stored, removed, tier)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def republish(self) -> None:
        """Schedule a full re-publish (what an overflow does)."""
        with self._mutex:
            self.num_dropped += len(self._pending)
            self._pending.clear()
            self._republish = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return bool(self._pending) or self._republish or self._writing or self._filling or self._rotating

    async def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until everything published so far is in etcd; the revision of the last write."""
        async with asyncio.timeout(timeout_s):
            while self.busy:
                await asyncio.sleep(0.005)
        return self.revision

    def _etcd_holds(self, key: BlockKey) -> bool:
        """Whether etcd holds `key` once every op taken or pending is written (call under the mutex)."""
        if key in self._pending:
            return self._pending[key] is not None
        return key in self._written

    def _enqueue(self, stored: Iterable[BlockKey], removed: Iterable[BlockKey], tier: str) -> None:
        pending, written, uncertain = self._pending, self._written, self._uncertain
        for key, op in [*((k, tier) for k in stored), *((k, None) for k in removed)]:
            pending.pop(key, None)
            if written.get(key) == op and key not in uncertain:
                self.num_coalesced += 1  # etcd will hold exactly this already
                continue
            pending[key] = op
        if len(pending) > self.config.max_pending:
            self.num_overflows += 1
            self.num_dropped += len(pending)
            pending.clear()
            self._republish = True
            log.warning("node %s: publish queue overflow; full re-publish scheduled", self.node_id)

    def _take(self) -> dict[BlockKey, str | None]:
        with self._mutex:
            batch: dict[BlockKey, str | None] = {}
            while self._pending and len(batch) < self.config.max_batch:
                key = next(iter(self._pending))
                batch[key] = op = self._pending.pop(key)
                self._uncertain.discard(key)
                if op is None:
                    self._written.pop(key, None)
                else:
                    self._written[key] = op
            self._writing = bool(batch)
            self._batch_generation = self._generation
            return batch

    def _put_back(self, batch: dict[BlockKey, str | None]) -> None:
        with self._mutex:
            if not self._republish and self._batch_generation == self._generation:
                for key, op in batch.items():
                    self._pending.setdefault(key, op)
                    self._uncertain.add(key)  # some of its txns may have been applied

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if self.config.window_s:
                await asyncio.sleep(self.config.window_s)
            self._wake.clear()
            try:
                await self._drain()
            except EtcdError as error:
                log.warning("node %s: etcd: %s; retrying in %.1fs", self.node_id, error, self.config.retry_s)
                await asyncio.sleep(self.config.retry_s)
                self._wake.set()

    async def _drain(self) -> None:
        while True:
            if self._republish:
                self._rotating = True  # busy until the old lease is revoked, not just until _fill ends
                try:
                    await self.membership.rotate()  # calls _fill under the new lease
                finally:
                    self._rotating = False
                continue
            if self.membership.lease_id is None:
                return  # not registered (yet, or any more): registering re-publishes everything
            batch = self._take()
            if not batch:
                return
            try:
                await self._write(batch)
            except LeaseNotFound:
                self.membership.lease_lost(self._lease_seen)  # its rotation re-puts everything
            except EtcdError:
                self._put_back(batch)
                raise
            finally:
                self._writing = False

    async def _write(self, batch: dict[BlockKey, str | None]) -> None:
        puts = [(self.layout.block_key(k, self.node_id), op.encode()) for k, op in batch.items() if op is not None]
        deletes = [self.layout.block_key(k, self.node_id) for k, op in batch.items() if op is None]
        async with self.membership.lock:
            if self.membership.lease_id is None or self._batch_generation != self._generation:
                return  # stopped (never write without a lease), or a fill since _take already covers it
            self._lease_seen = self.membership.lease_id
            self.revision = await self.client.apply(puts, deletes, self._lease_seen)
        self.num_written += len(batch)

    async def _fill(self, lease_id: int) -> None:
        """Runs inside Membership.rotate, under its lock: everything we hold, under the new lease."""
        with self._mutex:
            entries = published_entries(self.all_keys(), self.config.run_blocks, self._etcd_holds)  # tails kept
            self._pending.clear()
            self._republish = False
            self._filling = True
            self._generation += 1
            self._written, self._uncertain = dict(entries), set()
        try:
            puts = [(self.layout.block_key(key, self.node_id), tier.encode()) for key, tier in entries]
            if puts:
                self.revision = await self.client.apply(puts, [], lease_id)
        except EtcdError:
            with self._mutex:
                self._republish = True
            self._wake.set()
            raise
        finally:
            self._filling = False
        self.num_written += len(entries)
        log.info("node %s: re-published %d blocks under lease %x", self.node_id, len(entries), lease_id)
