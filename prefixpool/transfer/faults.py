"""Fault injection for chaos tests: a block source that corrupts what it serves, in transit.

    source_for(blocks, arena, corrupt_every=0)  -> the plain BlockSource (the null object: off)
    source_for(blocks, arena, corrupt_every=N)  -> CorruptingSource: every Nth block served
                                                 leaves with one payload byte flipped AFTER
                                                 its checksum was computed, as a bad link would

The arena itself is never touched: only the bytes on the wire are wrong, so
the receiver's checksum must catch it and the request must fall back to
recompute. Off by default; a worker reads the setting once at start.
Knows nothing of sockets, etcd or the router.
"""

from __future__ import annotations

from typing import AsyncIterator

from prefixpool.store.arena import KVArena
from prefixpool.store.node_blocks import NodeBlocks
from prefixpool.store.record import RecordHeader, header_for
from prefixpool.transfer.source import BlockSource, Outgoing


class CorruptingSource(BlockSource):
    """Flips one byte of every `every`-th payload it sends; counts what it corrupted."""

    def __init__(self, blocks: NodeBlocks, arena: KVArena, every: int) -> None:
        super().__init__(blocks, arena)
        if every < 1:
            raise ValueError(f"corrupt every N blocks needs N >= 1, got {every}")
        self.every = every
        self.num_served = 0
        self.num_corrupted = 0

    async def records(self, outgoing: Outgoing) -> AsyncIterator[tuple[RecordHeader, memoryview]]:
        for key, block_id in zip(outgoing.keys, outgoing.block_ids):
            payload = self.payload(block_id)
            header = header_for(key, payload)
            self.num_served += 1
            if self.num_served % self.every == 0:
                self.num_corrupted += 1
                damaged = bytearray(payload)  # a copy: the holder's own block stays good
                damaged[len(damaged) // 2] ^= 0xFF
                payload = memoryview(damaged)
            yield header, payload


def source_for(blocks: NodeBlocks, arena: KVArena, corrupt_every: int = 0) -> BlockSource:
    """The source a server should use: plain unless a fault is asked for."""
    return CorruptingSource(blocks, arena, corrupt_every) if corrupt_every else BlockSource(blocks, arena)


def num_corrupted(source: BlockSource) -> int:
    """Blocks this source sent damaged (0 for a plain source)."""
    return getattr(source, "num_corrupted", 0)
