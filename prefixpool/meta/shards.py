"""Index shards, the node side: block keys spread over K etcd clusters by key hash.

    shard_of(key) = bytes 8..12 of the key, little-endian, mod K     (the key is a hash already:
                                                                      nothing is hashed again)
    (bytes 8..12, not the last byte, which makes a run boundary (meta/runs.py): every shard gets
    the same share of boundaries; the router index's fingerprint mixes all 16 bytes anyway)
    shard 0 is the home shard: the node's record there carries its load (what routers read), and
    routers publish their in-flight load there; every shard holds the node's record once per
    lease, under that shard's own lease, so each shard is a whole etcd cluster of its own
    (readable alone with etcdctl) and a dead node's keys leave every shard by lease expiry.

    ShardedMembership   K Memberships (a lease per shard); load reports go to shard 0 only
    ShardedPublisher    K Publishers; publish() sends each key to its shard's, so a shard's
                        overflow, retry or lease rotation re-puts only that shard's keys
    node_index(...)     the plain Membership + Publisher for one shard (nothing sharded is built),
                        the sharded pair for more

A shard that is down at join is registered in the background once it answers; until then its
keys are not in the index anywhere (a miss, never a wrong answer). Run-granular keys shard by the
run's key, whatever it is: the publisher sees only the keys it is given. Knows nothing of the
router, the block pool or HTTP; the router side is prefixpool.meta.sharded_mirror.
"""

from __future__ import annotations

import asyncio
from typing import Collection, Iterable, Sequence

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import Membership, MembershipConfig, NodeRecord
from prefixpool.meta.publisher import AllKeys, Publisher, PublisherConfig
from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import DEVICE


def parse_shards(text: str) -> tuple[str, ...]:
    """'a:2379,b:2379;c:2379' -> ('a:2379,b:2379', 'c:2379'): one etcd cluster's endpoints per shard."""
    shards = tuple(",".join(e.strip() for e in part.split(",") if e.strip()) for part in text.split(";"))
    shards = tuple(s for s in shards if s)
    for shard in shards:
        for endpoint in shard.split(","):
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd shard endpoint {endpoint!r} is not host:port")
    return shards


def shard_of(key: BlockKey, num_shards: int) -> int:
    return int.from_bytes(key[8:12], "little") % num_shards


def split(keys: Iterable[BlockKey], num_shards: int) -> list[list[BlockKey]]:
    """The keys of each shard, in their given order."""
    parts: list[list[BlockKey]] = [[] for _ in range(num_shards)]
    for key in keys:
        parts[int.from_bytes(key[8:12], "little") % num_shards].append(key)
    return parts


def shard_keys(all_keys: AllKeys, shard: int, num_shards: int) -> AllKeys:
    """all_keys restricted to one shard (what that shard's lease rotation re-puts)."""
    return lambda: [(key, tier) for key, tier in all_keys() if shard_of(key, num_shards) == shard]


class ShardedMembership:
    """The node's lease in every shard; it looks like one Membership to the node (record, load, stop)."""

    def __init__(self, shards: Sequence[Membership]) -> None:
        assert len(shards) > 1, "one shard needs no ShardedMembership"
        self.shards = list(shards)

    @property
    def home(self) -> Membership:
        return self.shards[0]

    @property
    def record(self) -> NodeRecord:
        return self.home.record

    @record.setter
    def record(self, record: NodeRecord) -> None:
        """What every shard registers next (the vLLM sidecar sets it before each registration)."""
        for membership in self.shards:
            membership.record = record

    @property
    def lease_id(self) -> int | None:
        return self.home.lease_id

    @property
    def num_rotations(self) -> int:
        return sum(m.num_rotations for m in self.shards)

    async def start(self, *, patient: bool = False) -> None:
        """Register in the home shard (raises EtcdError when it is down, as one etcd does, unless patient),
        then in every other shard; one that does not answer is registered in the background when it does."""
        await self.home.start(patient=patient)
        for membership in self.shards[1:]:
            await membership.start(patient=True)

    async def stop(self) -> None:
        """Revoke every shard's lease (a shard that is down lets it expire)."""
        await asyncio.gather(*(m.stop() for m in self.shards))

    def update_load(self, num_queued: int, num_running: int, prefill_tokens_per_s: float) -> None:
        """Only the home shard's record carries the load: routers read records there."""
        self.home.update_load(num_queued, num_running, prefill_tokens_per_s)

    def update_adapters(self, adapters: tuple[str, ...]) -> None:
        self.home.update_adapters(adapters)


class ShardedPublisher:
    """One Publisher per shard behind the one publish() the node calls."""

    def __init__(self, shards: Sequence[Publisher]) -> None:
        assert len(shards) > 1, "one shard needs no ShardedPublisher"
        self.shards = list(shards)

    @property
    def node_id(self) -> str:
        return self.shards[0].node_id

    @property
    def config(self) -> PublisherConfig:
        return self.shards[0].config

    async def start(self) -> None:
        for publisher in self.shards:
            await publisher.start()

    async def stop(self) -> None:
        for publisher in self.shards:
            await publisher.stop()

    def publish(self, stored: Iterable[BlockKey] = (), removed: Iterable[BlockKey] = (), tier: str = DEVICE,
                tails: Collection[BlockKey] | None = None) -> None:
        """Non-blocking, thread-safe: each key to its shard's publisher (stored's last key a tail in its own only)."""
        stored, num_shards = list(stored), len(self.shards)
        tails = stored[-1:] if tails is None else tails
        for publisher, put, gone in zip(self.shards, split(stored, num_shards), split(removed, num_shards)):
            if put or gone:
                publisher.publish(put, gone, tier, tails)

    def republish(self) -> None:
        for publisher in self.shards:
            publisher.republish()

    @property
    def num_pending(self) -> int:
        return sum(p.num_pending for p in self.shards)

    @property
    def num_written(self) -> int:
        return sum(p.num_written for p in self.shards)

    @property
    def num_dropped(self) -> int:
        return sum(p.num_dropped for p in self.shards)

    @property
    def num_coalesced(self) -> int:
        return sum(p.num_coalesced for p in self.shards)

    @property
    def busy(self) -> bool:
        return any(p.busy for p in self.shards)

    @property
    def revision(self) -> tuple[int, ...]:
        return tuple(p.revision for p in self.shards)

    async def flush(self, timeout_s: float = 30.0) -> tuple[int, ...]:
        """Wait until everything published so far is in every shard; each shard's revision of its last
        write (ShardedMirror.wait_revision takes them)."""
        return tuple(await asyncio.gather(*(p.flush(timeout_s) for p in self.shards)))


def node_index(clients: Sequence[EtcdClient], layout: Layout, record: NodeRecord, all_keys: AllKeys,
               membership_config: MembershipConfig = MembershipConfig(),
               publisher_config: PublisherConfig = PublisherConfig(),
               ) -> tuple[Membership | ShardedMembership, Publisher | ShardedPublisher]:  # fmt: skip
    """A node's membership and publisher over one etcd client per shard."""
    if len(clients) == 1:
        membership = Membership(clients[0], layout, record, membership_config)
        return membership, Publisher(clients[0], membership, all_keys, publisher_config)
    memberships = [Membership(client, layout, record, membership_config) for client in clients]
    publishers = [Publisher(client, membership, shard_keys(all_keys, shard, len(clients)), publisher_config)
                  for shard, (client, membership) in enumerate(zip(clients, memberships))]  # fmt: skip
    return ShardedMembership(memberships), ShardedPublisher(publishers)
