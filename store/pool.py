"""One node's paged block pool: key index, ref counts and the free queue.

    match(keys)   -> block ids of the longest cached prefix (no side effects)
    touch(ids)    -> pin blocks (ref_count += 1; leaves the free queue at 0 -> 1)
    allocate(n)   -> Allocation(block_ids, evicted keys); the new blocks are pinned
    commit(id, k) -> the block now answers for key k (False if k already had one)
    free(ids)     -> unpin; blocks reaching 0 join the free queue, tail first

Data structure only: it returns what changed (evicted keys, whether a commit
stored anything) and the caller publishes it. Knows nothing of tensors,
etcd or the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from store.free_queue import FreeQueue
from store.keys import BlockKey


class PoolExhausted(Exception):
    """Not enough unpinned blocks to satisfy an allocation; nothing was changed."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} blocks, only {available} are free")
        self.requested = requested
        self.available = available


@dataclass(frozen=True, slots=True)
class Allocation:
    block_ids: list[int]
    evicted: list[BlockKey]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.key_of: list[BlockKey | None] = [None] * num_blocks
        self.index: dict[BlockKey, int] = {}
        self.free_queue = FreeQueue(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def lookup(self, key: BlockKey) -> int | None:
        return self.index.get(key)

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """Block ids of the longest run of cached keys from keys[0]."""
        found: list[int] = []
        index = self.index
        for key in keys:
            block_id = index.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def touch(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self.ref_count[block_id] == 0:
                self.free_queue.remove(block_id)
            self.ref_count[block_id] += 1

    def allocate(self, num: int) -> Allocation:
        if num > len(self.free_queue):
            raise PoolExhausted(num, len(self.free_queue))
        block_ids: list[int] = []
        evicted: list[BlockKey] = []
        for _ in range(num):
            block_id = self.free_queue.pop()
            key = self.key_of[block_id]
            if key is not None:
                del self.index[key]
                self.key_of[block_id] = None
                evicted.append(key)
            self.ref_count[block_id] = 1
            block_ids.append(block_id)
        return Allocation(block_ids, evicted)

    def commit(self, block_id: int, key: BlockKey) -> bool:
        """Register a pinned, fully written block under `key`.

        Returns False (and stores nothing) when another block already holds
        `key`: one key never has two live blocks.
        """
        assert self.ref_count[block_id] > 0, f"commit of unpinned block {block_id}"
        assert self.key_of[block_id] is None, f"block {block_id} already committed"
        if key in self.index:
            return False
        self.index[key] = block_id
        self.key_of[block_id] = key
        return True

    def free(self, block_ids: Sequence[int]) -> None:
        """Unpin a request's blocks, tail first, so chain tails are evicted before heads."""
        for block_id in reversed(block_ids):
            count = self.ref_count[block_id]
            assert count > 0, f"block {block_id} freed more often than pinned"
            self.ref_count[block_id] = count - 1
            if count == 1:
                if self.key_of[block_id] is None:
                    self.free_queue.push_front(block_id)
                else:
                    self.free_queue.push(block_id)

    def drop(self, key: BlockKey) -> bool:
        """Forget an unpinned cached key (e.g. its bytes were found corrupt)."""
        block_id = self.index.get(key)
        if block_id is None or self.ref_count[block_id] > 0:
            return False
        del self.index[key]
        self.key_of[block_id] = None
        self.free_queue.remove(block_id)
        self.free_queue.push_front(block_id)
        return True

    def cached_keys(self) -> list[BlockKey]:
        return list(self.index)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant between the structures is broken."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "free queue holds a block twice"
        for block_id in range(self.num_blocks):
            count = self.ref_count[block_id]
            assert count >= 0, f"block {block_id} has ref_count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: ref_count {count} vs free queue"
            key = self.key_of[block_id]
            if key is not None:
                assert self.index.get(key) == block_id, f"block {block_id} key not indexed"
        assert len(self.index) == sum(k is not None for k in self.key_of), "index has orphans"
