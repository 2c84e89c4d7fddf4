"""Checksums of a node's committed blocks: computed once, reused until the block is written again.

A committed block's bytes do not change while it answers for its key: a block
is written only between `allocate` and `commit`. So the xxh3-64 of its payload
(what a record header carries, prefixpool/store/record.py) holds from its first send, or
from the verified record it arrived in, until the block is allocated again:

    checksums.of(block_id, payload)     the cached value, or computed from `payload` now
    checksums.remember(block_id, value) a checksum already verified against these bytes
    checksums.forget(block_ids)         NodeBlocks, whenever it allocates those blocks

A holder serving a popular prefix to many peers hashes each block once, not
once per fetch; every receiver still verifies every block it takes. Knows
nothing of keys, pools, sockets or tiers.
"""

from __future__ import annotations

from typing import Iterable

from prefixpool.store.record import checksum


class BlockChecksums:
    def __init__(self) -> None:
        self._by_block: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._by_block

    def of(self, block_id: int, payload: bytes | bytearray | memoryview) -> int:
        known = self._by_block.get(block_id)
        if known is None:
            known = self._by_block[block_id] = checksum(payload)
        return known

    def remember(self, block_id: int, value: int) -> None:
        self._by_block[block_id] = value

    def forget(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._by_block.pop(block_id, None)
