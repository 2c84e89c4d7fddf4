"""The LRU queue of free blocks: which block `allocate` reuses next.

    head (evicted first)                                  tail (evicted last)
    [keyless blocks] [cached, least recently freed] ... [cached, just freed]

A freed block keeps its key and stays hittable while it waits here (lazy
eviction); a hit takes it out again in O(1). Blocks without a key go to the
head, since reusing them loses nothing. Knows nothing of keys or ref counts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class FreeQueue:
    """Ordered set of free block ids with O(1) push, pop-oldest and remove."""

    __slots__ = ("_order",)

    def __init__(self, block_ids: range | list[int] = ()) -> None:
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def push(self, block_id: int) -> None:
        """Append at the tail: the last to be evicted."""
        assert block_id not in self._order, f"block {block_id} freed twice"
        self._order[block_id] = None

    def push_front(self, block_id: int) -> None:
        """Insert at the head: the next to be reused."""
        self.push(block_id)
        self._order.move_to_end(block_id, last=False)

    def pop(self) -> int:
        """Take the block at the head."""
        return self._order.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        del self._order[block_id]
