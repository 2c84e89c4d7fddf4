"""The host-memory tier: a fixed arena of block-sized slots with its own LRU index.

    slots   uint8 [num_blocks, block_bytes]  (page-locked where CUDA is present,
                                             so host -> device copies can be async)
    index   key -> slot, oldest first:  [victim ... most recently stored or read]

A slot holds the raw bytes of one device block, nothing more. `put` needs a
free slot; making room (choosing a victim, copying it further down) is the
tier chain's job, because the victim's bytes must leave before the slot is
reused. Knows nothing of the device pool, files or etcd.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import HOST


def as_uint8(payload: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    """A flat uint8 tensor over `payload` without copying where possible."""
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1).view(torch.uint8)
    array = np.frombuffer(payload, dtype=np.uint8)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class HostTier:
    name = HOST

    def __init__(self, num_blocks: int, block_bytes: int, pin_memory: bool | None = None) -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError("a host tier needs num_blocks > 0 and block_bytes > 0 (size 0: do not construct it)")
        pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.slots = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.slots.zero_()  # fault every page in now, not on the eviction path
        self.index: OrderedDict[BlockKey, int] = OrderedDict()
        self.free_slots = list(range(num_blocks - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.index

    def full(self) -> bool:
        return not self.free_slots

    def victim(self) -> BlockKey:
        """The least recently used key: the next one to leave."""
        return next(iter(self.index))

    def put(self, key: BlockKey, payload: torch.Tensor | bytes | bytearray | memoryview) -> bool:
        """Copy one block in; False if the key was already here (it becomes most recent)."""
        if key in self.index:
            self.index.move_to_end(key)
            return False
        source = as_uint8(payload)
        if source.numel() != self.block_bytes:
            raise ValueError(f"host tier blocks are {self.block_bytes} bytes, got {source.numel()}")
        slot = self.free_slots.pop()
        self.slots[slot].copy_(source)
        self.index[key] = slot
        return True

    def view(self, key: BlockKey) -> torch.Tensor:
        """Zero-copy view of a stored block (valid until the key is removed)."""
        return self.slots[self.index[key]]

    def remove(self, key: BlockKey) -> bool:
        slot = self.index.pop(key, None)
        if slot is None:
            return False
        self.free_slots.append(slot)
        return True

    def check_integrity(self) -> None:
        used = set(self.index.values())
        assert len(used) == len(self.index), "two keys share a slot"
        assert not used & set(self.free_slots), "a slot is both used and free"
        assert len(used) + len(self.free_slots) == self.num_blocks, "a slot went missing"
