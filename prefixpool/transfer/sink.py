"""The receiver's side of a fetch: allocate, take each payload in place, verify, commit.

    sink = BlockSink(blocks, arena, keys)                        # an empty hold
    n = sink.expect(response.num_blocks, response.block_bytes)  # blocks.allocate into it
    for i in range(n):
        recv_into(sink.destination(i))       # the arena block itself on CPU,
        if not sink.accept(i, header): break # a host staging buffer on CUDA
    result = sink.finish()                   # or sink.abort() on an error

A block is committed only after its checksum matched; the first bad block
rejects itself and every later one, and blocks allocated but never committed
are released without a key, so they never answer a match. Transport-agnostic,
and every method goes through the node's blocks, so all run on the event loop
thread. Knows nothing of sockets or UCX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from prefixpool.store.arena import KVArena
from prefixpool.store.keys import BlockKey
from prefixpool.store.node_blocks import Hold, NodeBlocks
from prefixpool.store.record import RecordError, RecordHeader, verify
from prefixpool.transfer.errors import ProtocolError
from prefixpool.transfer.host_bytes import host_blocks


@dataclass(slots=True)
class FetchResult:
    """What arrived intact: `hold` holds its committed blocks; the caller releases it."""

    keys: list[BlockKey]
    hold: Hold
    evicted: list[BlockKey]
    num_bytes: int

    @property
    def block_ids(self) -> list[int]:
        return self.hold.block_ids

    @property
    def num_blocks(self) -> int:
        return len(self.hold.block_ids)


class _Staging:
    """Host buffers for an arena outside host memory: one per block in flight, reused."""

    def __init__(self, block_bytes: int, pin: bool) -> None:
        self.block_bytes = block_bytes
        self.pin = pin
        self.spare: list[torch.Tensor] = []
        self.lent: dict[int, torch.Tensor] = {}

    def buffer(self, index: int) -> memoryview:
        if index not in self.lent:
            spare = self.spare.pop() if self.spare else None
            self.lent[index] = (spare if spare is not None
                                else torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin))
        return memoryview(self.lent[index].numpy()).cast("B")

    def give_back(self, index: int) -> None:
        self.spare.append(self.lent.pop(index))


class BlockSink:
    def __init__(self, blocks: NodeBlocks, arena: KVArena, keys: Sequence[BlockKey]) -> None:
        self.blocks = blocks
        self.arena = arena
        self.keys = list(keys)
        self.hold = blocks.acquire(())  # the blocks this fetch writes; block i answers for keys[i] once committed
        self.num_expected = 0
        self.num_committed = 0
        self.evicted: list[BlockKey] = []
        self.rejected = False
        self._host_bytes = host_blocks(arena)
        self._staging = (None if self._host_bytes is not None
                         else _Staging(arena.block_bytes, pin=arena.device.type == "cuda"))

    def expect(self, num_blocks: int, block_bytes: int) -> int:
        """Allocate for the holder's answer; returns how many blocks to receive (may be fewer)."""
        if block_bytes != self.arena.block_bytes:
            raise ProtocolError(f"peer blocks are {block_bytes} bytes, ours are {self.arena.block_bytes}")
        if num_blocks > len(self.keys):
            raise ProtocolError(f"peer offers {num_blocks} blocks for {len(self.keys)} keys")
        self.evicted = self.blocks.allocate(self.hold, min(num_blocks, self.blocks.num_free))
        self.num_expected = len(self.hold.block_ids)
        return self.num_expected

    def destination(self, index: int) -> memoryview:
        """Where payload `index` lands: the block itself, or a staging buffer to copy from."""
        if self._host_bytes is not None:
            return self._host_bytes(self.hold.block_ids[index])
        return self._staging.buffer(index)

    def reject(self) -> None:
        """Refuse the block in flight and every later one (e.g. its header did not parse)."""
        self.rejected = True

    def check_header(self, index: int, header: RecordHeader) -> bool:
        """Whether block `index`'s header is the one we asked for; rejects the rest if not."""
        if header.key != self.keys[index] or header.payload_bytes != self.arena.block_bytes:
            self.rejected = True
        return not self.rejected

    def accept(self, index: int, header: RecordHeader) -> bool:
        """Verify and commit block `index` (blocks arrive in order); False rejects it and the rest."""
        assert index == self.num_committed, f"block {index} accepted out of order"
        if self.rejected or not self.check_header(index, header):
            return False
        payload = self.destination(index)
        try:
            verify(header, payload)
        except RecordError:
            self.rejected = True
            return False
        if self._staging is not None:
            self.arena.write_bytes(self.hold.block_ids[index], payload)
            self._staging.give_back(index)
        block_id = self.hold.block_ids[index]
        if self.blocks.commit(self.hold, index, [header.key]):
            self.blocks.checksums.remember(block_id, header.checksum)  # verified: serving it on needs no hash
        else:
            self.blocks.adopt(self.hold, index, header.key)  # a concurrent fetch committed this key first
        self.num_committed += 1
        return True

    def finish(self) -> FetchResult:
        """Release what never got committed; hand the committed prefix (held) to the caller."""
        num_blocks = self.num_committed
        self.blocks.release(self.hold, keep=num_blocks)
        return FetchResult(self.keys[:num_blocks], self.hold, self.evicted, num_blocks * self.arena.block_bytes)

    def abort(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """Release everything this fetch holds; returns (stored keys, evicted keys) for the error."""
        self.blocks.release(self.hold)
        stored = self.keys[: self.num_committed]
        self.num_committed = 0
        return stored, self.evicted
