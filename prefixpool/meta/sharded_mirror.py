"""Index shards, the router side: one Mirror per etcd shard, all applying into one shared index.

    shard 0 (home): node records, router loads, and its share of the blocks
    shard s > 0:    its share of the blocks (node records there only anchor the leases)

    etcd shard 0 --watch--> ShardMirror 0 --+
                                            +--> one ShardedIndex (a BlockIndex)  <-- longest_prefix(keys)
    etcd shard 1 --watch--> ShardMirror 1 --+

A key's shard is a function of the key (shards.shard_of: bytes 8..12 mod K), and the index's
fingerprint keeps those bytes whole (block_table.key_words), so one table holds every shard's
blocks and still knows each block's shard: a prompt is one lookup, as with one etcd, and a
shard's blocks can be forgotten alone (a pass over the table). A shard's mirror applies only its
own shard's keys (another's, misplaced, is skipped as foreign), and

    snapshot (first, or a resync)   forgets its shard's blocks, then adds the snapshot's
    etcd down / watch broken        forgets its shard's blocks until its fresh snapshot

so a shard that is down holds nothing: its keys are misses, and a prefix ends at its first key in
that shard. A shard never lengthens a prefix, so a shard down never makes a wrong answer: the
request recomputes what is unknown, and the router keeps serving. With run-granular publication
(MirrorConfig.run_blocks) the same index answers the request's run keys (prefixpool.meta.runs), as
a single Mirror's does. Every shard's mirror runs on the one event loop that calls start(), and
applies each snapshot or watch batch without awaiting in between, as one Mirror does.

Knows nothing of HTTP, policies or how blocks are published (prefixpool.meta.shards).
"""

from __future__ import annotations

import asyncio
from typing import Iterable, Sequence

from prefixpool.meta.block_table import key_words
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.fleet_load import FleetLoad
from prefixpool.meta.index import BlockIndex
from prefixpool.meta.layout import BlockEntry, Layout
from prefixpool.meta.membership import NodeRecord
from prefixpool.meta.mirror import Mirror, MirrorConfig
from prefixpool.meta.shards import shard_of
from prefixpool.store.keys import BlockKey


class ShardedIndex(BlockIndex):
    """One BlockIndex holding the blocks of `num_shards` shards, each shard's forgettable alone."""

    def __init__(self, num_shards: int) -> None:
        super().__init__()
        self.num_shards = num_shards

    def remove_shard(self, shard: int) -> None:
        """Every node forgets the blocks of `shard` (one pass over the table); other shards' stay."""
        self.remove_where(lambda fps: key_words(fps) % self.num_shards == shard)


class ShardMirror(Mirror):
    """One shard's Mirror: its blocks go into the index every shard shares (its `index`, num_keys() and
    held_blocks() are the shared index's, every shard's)."""

    def __init__(self, client: EtcdClient, layout: Layout, config: MirrorConfig, index: ShardedIndex,
                 shard: int) -> None:  # fmt: skip
        super().__init__(client, layout, config)
        self.index: ShardedIndex = index
        self.shard = shard

    def _clear_index(self) -> None:
        self.index.remove_shard(self.shard)

    def _lose(self) -> None:
        if self.connected:  # once: retries while it stays down find nothing of it left
            self.index.remove_shard(self.shard)
        super()._lose()

    def _parse_block(self, key: bytes) -> BlockEntry | None:
        entry = super()._parse_block(key)
        return entry if entry is None or shard_of(entry.key, self.index.num_shards) == self.shard else None


class ShardedMirror:
    """K Mirrors, one per shard, into one shared index, behind the Mirror's read API (the router's ClusterView):
    what reads the index goes to the home shard's mirror, whose index is everyone's."""

    def __init__(self, clients: Sequence[EtcdClient], layout: Layout, config: MirrorConfig = MirrorConfig()) -> None:
        assert len(clients) > 1, "one shard needs no ShardedMirror"
        shared = ShardedIndex(len(clients))
        self.shards = [ShardMirror(client, layout, config, shared, shard) for shard, client in enumerate(clients)]
        self.layout, self.run_blocks = layout, config.run_blocks

    @property
    def home(self) -> ShardMirror:
        return self.shards[0]

    @property
    def nodes(self) -> dict[str, NodeRecord]:
        return self.home.nodes

    @property
    def fleet(self) -> FleetLoad:
        return self.home.fleet

    @property
    def revision(self) -> tuple[int, ...]:
        return tuple(m.revision for m in self.shards)

    @property
    def num_resyncs(self) -> int:
        return sum(m.num_resyncs for m in self.shards)

    @property
    def num_events(self) -> int:
        return sum(m.num_events for m in self.shards)

    @property
    def num_skipped(self) -> int:
        return sum(m.num_skipped for m in self.shards)

    async def start(self) -> None:
        for mirror in self.shards:
            await mirror.start()

    async def stop(self) -> None:
        for mirror in self.shards:
            await mirror.stop()

    def index(self) -> ShardedIndex:
        """Every shard's blocks in one index; a shard not connected holds nothing there (its blocks unknown)."""
        return self.home.index

    def num_keys(self) -> int:
        return self.home.num_keys()

    def lag_s(self) -> float:
        return max(m.lag_s() for m in self.shards)

    def workers(self) -> dict[str, NodeRecord]:
        return self.home.nodes

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """As Mirror.longest_prefix (at run granularity when runs are on), over every shard: one lookup."""
        return self.home.longest_prefix(keys)

    def held_blocks(self, node_id: str) -> int:
        return self.home.held_blocks(node_id)

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        """As Mirror.lower_tiers: with runs, a run counts in its boundary's tier."""
        return self.home.lower_tiers(node_id, keys)

    def holders_of(self, key: BlockKey) -> dict[str, str]:
        """{node: tier} of every holder of `key` (as BlockIndex.holders_of)."""
        return self.home.index.holders_of(key)

    def report_revision(self, node_id: str) -> int:
        return self.home.report_revision(node_id)

    def fleet_share(self, worker: str, exclude: str) -> tuple[int, int]:
        return self.home.fleet_share(worker, exclude)

    async def wait_revision(self, revision: int | Sequence[int], timeout_s: float = 10.0) -> None:
        """Until every shard has applied up to its revision (one int: the same for all; a tuple: what
        ShardedPublisher.flush returns, one per shard)."""
        revisions = [revision] * len(self.shards) if isinstance(revision, int) else list(revision)
        assert len(revisions) == len(self.shards), "one revision per shard"
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(m.wait_revision(r, timeout_s) for m, r in zip(self.shards, revisions)))


def index_mirror(clients: Sequence[EtcdClient], layout: Layout,
                 config: MirrorConfig = MirrorConfig()) -> Mirror | ShardedMirror:  # fmt: skip
    """The plain Mirror over one etcd cluster; a ShardedMirror over more."""
    return Mirror(clients[0], layout, config) if len(clients) == 1 else ShardedMirror(clients, layout, config)
