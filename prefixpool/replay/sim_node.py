"""One simulated prefill node's cache: a real device pool over modelled host and SSD LRUs.

    device  prefixpool.store.node_blocks.NodeBlocks over a BlockPool (the LRU the real worker runs)
    host    OrderedDict LRU, exclusive of the device: an evicted device block lands here,
            a hit is promoted back up (leaves host)
    ssd     OrderedDict LRU fed by host's victims; keeps its copy on promotion;
            its own victims are dropped

Only keys are modelled (no bytes): the simulator needs which tier a block is
in, not its contents. `store` returns every key whose tier changed, so the
caller can put each into the index in its fastest tier, or remove it.
With host and SSD sizes 0 this is exactly the device-only LRU. Knows nothing
of routing, traces or timing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pool import BlockPool
from prefixpool.store.tier_names import DEVICE, DISK, HOST



class SimNode:
    def __init__(self, name: str, capacity: int, host_blocks: int = 0, disk_blocks: int = 0) -> None:
        self.name = name
        self.blocks = NodeBlocks(BlockPool(capacity))
        self.host: OrderedDict[BlockKey, None] = OrderedDict()
        self.disk: OrderedDict[BlockKey, None] = OrderedDict()
        self.host_blocks, self.disk_blocks = host_blocks, disk_blocks
        self.free_at = 0.0
        self.busy_s = 0.0
        self.queued_tokens = 0

    def tier_of(self, key: BlockKey) -> str | None:
        if self.blocks.lookup(key) is not None:
            return DEVICE
        if key in self.host:
            return HOST
        return DISK if key in self.disk else None

    def lower_blocks(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """How many of `keys` (a held prefix) sit in host and on the SSD: what a hit must read up."""
        counts: dict[str, int] = {}
        for key in keys:
            tier = self.tier_of(key)
            if tier is not None and tier != DEVICE:
                counts[tier] = counts.get(tier, 0) + 1
        return counts

    def store(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Cache a finished request's blocks on the device (promoting lower-tier hits); the keys that changed tier."""
        keys = keys[: self.blocks.num_blocks]
        hold = self.blocks.acquire(keys)
        num_hit = len(hold.block_ids)
        evicted = self.blocks.allocate(hold, len(keys) - num_hit)
        stored = self.blocks.commit(hold, num_hit, keys[num_hit:])
        self.blocks.release(hold)
        for key in stored:
            self.host.pop(key, None)  # promoted: host is exclusive of the device
        touched = stored + evicted
        for key in evicted:
            touched += self._demote(key)
        return touched

    def _demote(self, key: BlockKey) -> list[BlockKey]:
        if not self.host_blocks:
            return self._to_disk(key)
        self.host[key] = None
        self.host.move_to_end(key)
        touched: list[BlockKey] = []
        while len(self.host) > self.host_blocks:
            victim, _ = self.host.popitem(last=False)
            touched += [victim, *self._to_disk(victim)]
        return touched

    def _to_disk(self, key: BlockKey) -> list[BlockKey]:
        if not self.disk_blocks:
            return []
        self.disk[key] = None
        self.disk.move_to_end(key)
        touched: list[BlockKey] = []
        while len(self.disk) > self.disk_blocks:
            touched.append(self.disk.popitem(last=False)[0])
        return touched
