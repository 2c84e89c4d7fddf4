"""One node's blocks, built from sizes: the device pool over its arena and the tiers under it.

    node_blocks(arena, TierSizes(host_blocks, disk_blocks, disk_dir), min_residency_s, pins)
        -> NodeBlocks(BlockPool(arena.num_blocks), TierChain(arena, host?, disk?) or none, pins)

A tier of size 0 is not constructed, and with no tier there is no chain (NodeBlocks
gets NoTiers, the null object). Our worker's arena is on its device; the vLLM
pool's arena is in host memory and its only lower tier is the SSD. Knows nothing
of engines, vLLM, the network or etcd.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.store.arena import KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.pins import PrefixPins
from prefixpool.store.pool import BlockPool
from prefixpool.store.tiers import TierChain


@dataclass(frozen=True)
class TierSizes:
    host_blocks: int = 0  # host-memory tier under the arena (0: none)
    disk_blocks: int = 0  # SSD tier (0: none); needs disk_dir
    disk_dir: str = ""  # the SSD tier's block files, kept across restarts
    disk_queue_blocks: int = 64  # SSD write queue; a block demoted while it is full is dropped


def tier_chain(arena: KVArena, sizes: TierSizes) -> TierChain | None:
    """The tiers under the arena; None when there are none."""
    if sizes.host_blocks <= 0 and sizes.disk_blocks <= 0:
        return None
    if sizes.disk_blocks > 0 and not sizes.disk_dir:
        raise ValueError("an SSD tier (disk tier blocks > 0) needs a disk tier directory")
    host = HostTier(sizes.host_blocks, arena.block_bytes) if sizes.host_blocks > 0 else None
    disk = (DiskTier(sizes.disk_dir, arena.block_bytes, sizes.disk_blocks, sizes.disk_queue_blocks)
            if sizes.disk_blocks > 0 else None)
    return TierChain(arena, host, disk)


def node_blocks(arena: KVArena, sizes: TierSizes = TierSizes(), min_residency_s: float = 0.0,
                pins: PrefixPins | None = None) -> NodeBlocks:
    """A pool of the arena's blocks, with the tiers `sizes` asks for under it."""
    return NodeBlocks(BlockPool(arena.num_blocks, min_residency_s), tier_chain(arena, sizes), pins)
