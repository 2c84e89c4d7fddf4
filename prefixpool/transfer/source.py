"""The holder's side of a fetch: pin what is still held, hand out framed records, unpin.

    async with source.pinned(keys) as outgoing:   # blocks.promote + blocks.acquire
        async for header, payload in source.records(outgoing):
            ...send header.pack(), then payload...
                                                   # blocks.release on the way out

On a node with host or SSD tiers, the run sitting there is promoted into
device blocks first (the same copy a local hit makes), so a peer gets the
longest prefix this node holds in any tier; without lower tiers promote is a
no-op. Transport-agnostic: it never sees a socket. Every block operation runs
on the caller's thread, which must be the event loop's (NodeBlocks is not
thread-safe). The methods are the seams tests override to inject faults (an
eviction before pinning, a flipped byte, a stall). Knows nothing of the wire.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import Hold, NodeBlocks
from prefixpool.store.record import RecordHeader
from prefixpool.transfer.host_bytes import host_blocks


@dataclass(slots=True)
class Outgoing:
    """The pinned prefix one request is served from."""

    keys: list[BlockKey]
    hold: Hold

    @property
    def block_ids(self) -> list[int]:
        return self.hold.block_ids

    @property
    def num_blocks(self) -> int:
        return len(self.hold.block_ids)


class BlockSource:
    def __init__(self, blocks: NodeBlocks, arena: KVArena) -> None:
        self.blocks = blocks
        self.arena = arena
        self._host_bytes = host_blocks(arena)
        self.num_sending = 0  # fetches being served now (a draining worker waits for them)

    @property
    def block_bytes(self) -> int:
        return self.arena.block_bytes

    async def pin(self, keys: Sequence[BlockKey]) -> Outgoing:
        """Hold the longest prefix of `keys` still held in any tier; the rest is not ours to send."""
        self.blocks.promote(keys)
        hold = self.blocks.acquire(keys)
        return Outgoing(list(keys[: len(hold.block_ids)]), hold)

    def release(self, outgoing: Outgoing) -> None:
        self.blocks.release(outgoing.hold)

    @asynccontextmanager
    async def pinned(self, keys: Sequence[BlockKey]) -> AsyncIterator[Outgoing]:
        self.num_sending += 1
        try:
            outgoing = await self.pin(keys)
            try:
                yield outgoing
            finally:
                self.release(outgoing)
        finally:
            self.num_sending -= 1

    def payload(self, block_id: int) -> memoryview:
        """The block's bytes: zero-copy on CPU, one device-to-host copy on CUDA."""
        if self._host_bytes is not None:
            return self._host_bytes(block_id)
        return self.arena.read_bytes(block_id)

    async def records(self, outgoing: Outgoing) -> AsyncIterator[tuple[RecordHeader, memoryview]]:
        """(header, payload) per block, in key order; a block's checksum is computed on its first send only."""
        checksums = self.blocks.checksums
        for key, block_id in zip(outgoing.keys, outgoing.block_ids):
            payload = self.payload(block_id)
            yield RecordHeader(key, payload.nbytes, checksums.of(block_id, payload)), payload
