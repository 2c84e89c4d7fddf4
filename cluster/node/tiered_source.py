"""The transfer server's block source on a tiered node: serve blocks from any tier.

A peer asks for a run of keys. Before pinning the device prefix, the run
that sits in host memory or on the SSD is promoted into device blocks (the
same copy a local hit makes), so the peer gets the longest prefix this node
holds in any tier. What moved is noted in the tiers' touched keys, which
the worker publishes on its next collect tick. Knows nothing of the wire or etcd.
"""

from __future__ import annotations

from typing import Sequence

from cluster.node.tiers import NodeTiers
from store.arena import KVArena
from store.keys import BlockKey
from transfer.source import BlockSource, Outgoing


class TieredSource(BlockSource):
    def __init__(self, tiers: NodeTiers, arena: KVArena) -> None:
        super().__init__(tiers.pool, arena)
        self.tiers = tiers

    async def pin(self, keys: Sequence[BlockKey]) -> Outgoing:
        self.tiers.promote(keys)
        return await super().pin(keys)
