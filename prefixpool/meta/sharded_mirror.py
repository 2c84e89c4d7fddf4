"""Index shards, the router side: one Mirror per etcd shard, answered as one cluster view.

    shard 0 (home): node records, router loads, and its share of the blocks
    shard s > 0:    its share of the blocks (node records there only anchor the leases)

    longest_prefix(keys): each shard's index walks only its own keys, at its own speed, and
    the first miss over all shards ends a node's prefix:

        keys      k0 k1 k2 k3 k4 k5 k6
        shard      0  1  1  0  1  0  0
        shard 0   k0 k3 k5 k6   at 0 3 5 6   node n holds 2 in a row -> its first miss is at 5
        shard 1   k1 k2 k4      at 1 2 4     node n holds 3 in a row -> no miss (7, the end)
        n's prefix = min(5, 7) = 5 blocks

    A shard whose mirror is not connected (etcd down, stream broken, until its fresh
    snapshot) holds nothing: its keys are misses, so a prefix ends at its first key in that
    shard. A shard never lengthens a prefix, so a shard down never makes a wrong answer:
    the request recomputes what is unknown, and the router keeps serving. With run-granular
    publication (MirrorConfig.run_blocks) the same walk runs over the request's run-boundary
    keys (prefixpool.meta.runs), as a single Mirror's does.

Knows nothing of HTTP, policies or how blocks are published (prefixpool.meta.shards).
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from typing import Iterable, Protocol, Sequence

import numpy as np

from prefixpool.meta import runs
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.fleet_load import FleetLoad
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import NodeRecord
from prefixpool.meta.mirror import Mirror, MirrorConfig
from prefixpool.meta.shards import shard_of
from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import DEVICE


class ShardIndex(Protocol):
    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]: ...
    def num_lower(self, node_id: str) -> int: ...
    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]: ...
    def tier_of(self, node_id: str, key: BlockKey) -> str | None: ...


def shard_positions(keys: Sequence[BlockKey], num_shards: int) -> list[list[int]]:
    """Per shard, the positions in `keys` of its keys (shards.shard_of, vectorized)."""
    shards = np.frombuffer(b"".join(keys), dtype="<u4")[2::4] % num_shards
    return [np.flatnonzero(shards == s).tolist() for s in range(num_shards)]


def longest_prefix(indexes: Sequence[ShardIndex | None], keys: Sequence[BlockKey]) -> dict[str, int]:
    """Per node, how many of `keys` from keys[0] on it holds consecutively, each key looked up in its
    shard's index; None for a shard that is down (every key of it a miss). Nodes with 0 omitted."""
    if not keys:
        return {}
    positions = shard_positions(keys, len(indexes))
    first = next(s for s, at in enumerate(positions) if at and at[0] == 0)
    if indexes[first] is None:
        return {}
    ends: dict[str, int] = {}  # node -> its first miss so far (len(keys): none)
    for shard in [first, *(s for s in range(len(indexes)) if s != first)]:
        at, index = positions[shard], indexes[shard]
        if shard != first:  # only this shard's keys before the longest prefix so far can shorten one
            at = at[: bisect_left(at, max(ends.values(), default=0))]
        if not at:
            continue
        if index is None:
            ends = {node: min(end, at[0]) for node, end in ends.items()}
            continue
        matched = index.longest_prefix([keys[i] for i in at])
        if shard == first:
            ends = {node: len(keys) for node in matched}  # only holders of keys[0] can match
        for node, end in ends.items():
            held = matched.get(node, 0)
            ends[node] = min(end, at[held] if held < len(at) else len(keys))
    return ends


class ShardedIndex:
    """The K shards' indexes read as one (None: a shard that is down, which holds nothing)."""

    def __init__(self, indexes: Sequence[ShardIndex | None]) -> None:
        self.indexes = indexes

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        return longest_prefix(self.indexes, keys)

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        counts: dict[str, int] = {}
        if not any(index.num_lower(node_id) for index in self.indexes if index is not None):
            return counts  # most nodes hold nothing below the device: no split, no lookups
        keys = list(keys)
        if not keys:
            return counts
        for index, at in zip(self.indexes, shard_positions(keys, len(self.indexes))):
            if index is not None and at:
                for tier, num in index.lower_tiers(node_id, [keys[i] for i in at]).items():
                    counts[tier] = counts.get(tier, 0) + num
        return counts

    def tier_of(self, node_id: str, key: BlockKey) -> str | None:
        index = self.indexes[shard_of(key, len(self.indexes))]
        return None if index is None else index.tier_of(node_id, key)


class ShardedMirror:
    """K Mirrors, one per shard, behind the Mirror's read API (the router's ClusterView)."""

    def __init__(self, clients: Sequence[EtcdClient], layout: Layout, config: MirrorConfig = MirrorConfig()) -> None:
        assert len(clients) > 1, "one shard needs no ShardedMirror"
        self.shards = [Mirror(client, layout, config) for client in clients]
        self.layout, self.run_blocks = layout, config.run_blocks

    @property
    def home(self) -> Mirror:
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
        """Every shard's block index as one; a shard not connected holds nothing (its blocks unknown)."""
        return ShardedIndex([m.index if m.connected else None for m in self.shards])

    def num_keys(self) -> int:
        return sum(m.num_keys() for m in self.shards if m.connected)

    def lag_s(self) -> float:
        return max(m.lag_s() for m in self.shards)

    def workers(self) -> dict[str, NodeRecord]:
        return self.home.nodes

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """As Mirror.longest_prefix (at run granularity when runs are on), over every shard."""
        return runs.longest_prefix(self.index(), keys, self.run_blocks)

    def held_blocks(self, node_id: str) -> int:
        return sum(m.held_blocks(node_id) for m in self.shards if m.connected)

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        """As Mirror.lower_tiers: with runs, a run counts in its boundary's tier."""
        index = self.index()
        if self.run_blocks == 1:
            return index.lower_tiers(node_id, keys)
        counts: dict[str, int] = {}
        for key, length in runs.run_lengths(list(keys), self.run_blocks).items():
            tier = index.tier_of(node_id, key)
            if tier is not None and tier != DEVICE:
                counts[tier] = counts.get(tier, 0) + length
        return counts

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
