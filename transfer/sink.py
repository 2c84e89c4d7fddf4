"""The receiver's side of a fetch: allocate, take each payload in place, verify, commit.

    sink = BlockSink(pool, arena, keys)
    n = sink.expect(response.num_blocks, response.block_bytes)  # pool.allocate (pinned)
    for i in range(n):
        recv_into(sink.destination(i))       # the arena block itself on CPU,
        if not sink.accept(i, header): break # a host staging buffer on CUDA
    result = sink.finish()                   # or sink.abort() on an error

A block is committed only after its checksum matched; the first bad block
rejects itself and every later one, and blocks allocated but never committed
are freed without a key, so they never answer a match. Transport-agnostic,
and every method touches the pool, so all run on the event loop thread.
Knows nothing of sockets or UCX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from store.arena import KVArena
from store.keys import BlockKey
from store.pool import BlockPool
from store.record import RecordError, RecordHeader, verify
from transfer.errors import ProtocolError
from transfer.host_bytes import host_blocks


@dataclass(slots=True)
class FetchResult:
    """What arrived intact. `block_ids` are committed and pinned: the caller frees them."""

    keys: list[BlockKey]
    block_ids: list[int]
    evicted: list[BlockKey]
    num_bytes: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


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
            self.lent[index] = spare if spare is not None else torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
        return memoryview(self.lent[index].numpy()).cast("B")

    def give_back(self, index: int) -> None:
        self.spare.append(self.lent.pop(index))


class BlockSink:
    def __init__(self, pool: BlockPool, arena: KVArena, keys: Sequence[BlockKey]) -> None:
        self.pool = pool
        self.arena = arena
        self.keys = list(keys)
        self.allocated: list[int] = []
        self.evicted: list[BlockKey] = []
        self.committed: list[int] = []  # block ids in key order (pinned)
        self.rejected = False
        self._spares: list[int] = []  # allocated, then found a twin already committed
        self._host_bytes = host_blocks(arena)
        self._staging = None if self._host_bytes is not None else _Staging(arena.block_bytes, pin=arena.device.type == "cuda")

    def expect(self, num_blocks: int, block_bytes: int) -> int:
        """Allocate for the holder's answer; returns how many blocks to receive (may be fewer)."""
        if block_bytes != self.arena.block_bytes:
            raise ProtocolError(f"peer blocks are {block_bytes} bytes, ours are {self.arena.block_bytes}")
        if num_blocks > len(self.keys):
            raise ProtocolError(f"peer offers {num_blocks} blocks for {len(self.keys)} keys")
        allocation = self.pool.allocate(min(num_blocks, self.pool.num_free))
        self.allocated = allocation.block_ids
        self.evicted = allocation.evicted
        return len(self.allocated)

    def destination(self, index: int) -> memoryview:
        """Where payload `index` lands: the block itself, or a staging buffer to copy from."""
        if self._host_bytes is not None:
            return self._host_bytes(self.allocated[index])
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
        assert index == len(self.committed), f"block {index} accepted out of order"
        if self.rejected or not self.check_header(index, header):
            return False
        payload = self.destination(index)
        try:
            verify(header, payload)
        except RecordError:
            self.rejected = True
            return False
        block_id = self.allocated[index]
        if self._staging is not None:
            self.arena.write_bytes(block_id, payload)
            self._staging.give_back(index)
        self._commit(block_id, header.key)
        return True

    def _commit(self, block_id: int, key: BlockKey) -> None:
        if self.pool.commit(block_id, key):
            self.committed.append(block_id)
            return
        twin = self.pool.lookup(key)  # a concurrent fetch committed this key first
        assert twin is not None
        self.pool.touch([twin])
        self.committed.append(twin)
        self._spares.append(block_id)

    def _unused(self) -> list[int]:
        return self._spares + self.allocated[len(self.committed) :]

    def finish(self) -> FetchResult:
        """Free what never got committed; hand the committed prefix (pinned) to the caller."""
        self.pool.free(self._unused())
        num_blocks = len(self.committed)
        num_bytes = num_blocks * self.arena.block_bytes
        return FetchResult(self.keys[:num_blocks], list(self.committed), self.evicted, num_bytes)

    def abort(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """Unpin everything this fetch holds; returns (stored keys, evicted keys) for the error."""
        self.pool.free(self._unused())
        self.pool.free(self.committed)
        stored = self.keys[: len(self.committed)]
        self.committed = []
        self.allocated = []
        self._spares = []
        return stored, self.evicted
