"""A node's metadata side in this process, for tests and benchmarks: its membership and publisher
over one etcd client per index shard (prefixpool.meta.shards.node_index: the plain pair for one
shard, the sharded pair for more), over the keys it 'holds'.

    held        {key: tier} the node holds: what store()/evict() change and what a lease rotation
                re-puts (a caller that publishes through .publisher directly leaves it empty)
    revisions() per shard, the revision of everything the node wrote there (a mirror waits for it)
"""

from __future__ import annotations

from typing import Sequence

from prefixpool.meta.etcd_client import LARGE_TXN_OPS, EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import MembershipConfig, NodeRecord
from prefixpool.meta.publisher import PublisherConfig
from prefixpool.meta.shards import node_index
from prefixpool.store.tier_names import DEVICE


def local_record(node_id: str, block_size: int = 16, num_blocks: int = 64, model: str = "tiny") -> NodeRecord:
    """A record whose URLs name the node but lead nowhere (nothing fetches from a node of this module)."""
    return NodeRecord(node_id, f"http://127.0.0.1/{node_id}", f"tcp://127.0.0.1/{node_id}", block_size, num_blocks,
                      model)  # fmt: skip


class IndexNode:
    """Membership + publisher of one node over every shard's etcd; start() and stop() in the node's order."""

    def __init__(self, endpoints: str | Sequence[str], ns: str, record: NodeRecord,
                 membership_config: MembershipConfig = MembershipConfig(),
                 publisher_config: PublisherConfig = PublisherConfig(),
                 timeout_s: float = 5.0, max_txn_ops: int = LARGE_TXN_OPS) -> None:  # fmt: skip
        """`endpoints`: one etcd cluster's endpoint string, or one per shard."""
        shards = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.node_id = record.node_id
        self.held: dict[bytes, str] = {}
        self.clients = [EtcdClient(e, timeout_s=timeout_s, max_txn_ops=max_txn_ops) for e in shards]
        self.membership, self.publisher = node_index(self.clients, Layout(ns), record,
                                                     lambda: list(self.held.items()),
                                                     membership_config, publisher_config)  # fmt: skip

    @property
    def client(self) -> EtcdClient:
        """The home shard's client (the only one, unsharded)."""
        return self.clients[0]

    async def start(self, patient: bool = False):
        await self.publisher.start()
        await self.membership.start(patient=patient)
        return self

    async def stop(self) -> None:
        await self.publisher.stop()
        await self.membership.stop()
        for client in self.clients:
            await client.close()

    def store(self, keys, tier: str = DEVICE) -> None:
        for key in keys:
            self.held[key] = tier
        self.publisher.publish(stored=keys, tier=tier)

    def evict(self, keys) -> None:
        for key in keys:
            self.held.pop(key, None)
        self.publisher.publish(removed=keys)

    async def revisions(self, timeout_s: float = 60.0) -> list[int]:
        """Per shard, the revision of everything this node wrote there (blocks flushed, record, revokes)."""
        flushed = await self.publisher.flush(timeout_s)
        flushed = [flushed] if isinstance(flushed, int) else list(flushed)
        memberships = getattr(self.membership, "shards", [self.membership])
        return [max(f, m.revision) for f, m in zip(flushed, memberships)]
