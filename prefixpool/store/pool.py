"""One node's paged block pool: key index, ref counts and the free queue.

    match(keys)   -> block ids of the longest cached prefix (no side effects)
    touch(ids)    -> pin blocks (ref_count += 1; leaves the free queue at 0 -> 1)
    allocate(n)   -> Allocation(block_ids, evicted keys); the new blocks are pinned
    commit(id, k) -> the block now answers for key k (False if k already had one)
    free(ids)     -> unpin; blocks reaching 0 join the free queue, tail first
    pin(keys, ttl_s) / unpin(keys) -> keep cached keys from eviction until a deadline

Two production levers protect blocks beyond ref counts:
- minimum residency: a block committed at time t is not evicted before
  t + min_residency_s; `allocate` skips such blocks in the free queue and
  raises PoolExhausted when too few evictable blocks remain (never waits);
- pins: a pinned key holds one ref on its block (taken at pin time, or at
  commit for a key pinned before it was cached), so it is never in the free
  queue; the ref is released at unpin or, lazily, once the TTL has passed.

Data structure only: it returns what changed (evicted keys, whether a commit
stored anything) and the caller publishes it. Time comes from an injected
clock. Knows nothing of tensors, etcd or the network.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from prefixpool.store.free_queue import FreeQueue
from prefixpool.store.keys import BlockKey


class PoolExhausted(Exception):
    """Not enough unpinned blocks to satisfy an allocation; nothing was changed."""

    def __init__(self, requested: int, available: int, num_resident: int = 0) -> None:
        detail = f" ({num_resident} more are free but within their minimum residency)" if num_resident else ""
        super().__init__(f"requested {requested} blocks, only {available} are free{detail}")
        self.requested = requested
        self.available = available
        self.num_resident = num_resident


@dataclass(frozen=True, slots=True)
class Allocation:
    """New pinned blocks; `evicted[i]` was the key of block `evicted_block_ids[i]`.

    An evicted block's bytes are still intact in the arena until the caller
    writes it, so a tiered caller can copy them down first.
    """

    block_ids: list[int]
    evicted: list[BlockKey]
    evicted_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Pin:
    expires_at: float
    block_id: int | None  # the block whose ref this pin holds; None until the key is cached


class BlockPool:
    def __init__(
        self, num_blocks: int, min_residency_s: float = 0.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if min_residency_s < 0:
            raise ValueError(f"min_residency_s must be >= 0, got {min_residency_s}")
        self.num_blocks = num_blocks
        self.min_residency_s = min_residency_s
        self.clock = clock
        self.ref_count = [0] * num_blocks
        self.key_of: list[BlockKey | None] = [None] * num_blocks
        self.resident_until = [0.0] * num_blocks  # 0.0 for keyless blocks and when residency is off
        self.index: dict[BlockKey, int] = {}
        self.free_queue = FreeQueue(range(num_blocks))
        self.pins: dict[BlockKey, Pin] = {}
        self._pin_deadlines: list[tuple[float, BlockKey]] = []  # min-heap; stale entries skipped

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
        """Take `num` evictable free blocks from the LRU head; all or nothing."""
        now = self.clock()
        self.expire_pins(now)
        block_ids = self._evictable(num, now)
        if len(block_ids) < num:
            raise PoolExhausted(num, len(block_ids), len(self.free_queue) - len(block_ids))
        evicted: list[BlockKey] = []
        evicted_block_ids: list[int] = []
        for block_id in block_ids:
            self.free_queue.remove(block_id)
            key = self.key_of[block_id]
            if key is not None:
                del self.index[key]
                self.key_of[block_id] = None
                self.resident_until[block_id] = 0.0
                evicted.append(key)
                evicted_block_ids.append(block_id)
            self.ref_count[block_id] = 1
        return Allocation(block_ids, evicted, evicted_block_ids)

    def _evictable(self, num: int, now: float) -> list[int]:
        """Up to `num` free blocks in LRU order, skipping those still within their residency.

        Without residency this stops after `num` steps; with it, the scan
        also passes the resident blocks ahead of the evictable ones.
        """
        found: list[int] = []
        if num <= 0:
            return found
        resident_until = self.resident_until
        for block_id in self.free_queue:
            if resident_until[block_id] <= now:
                found.append(block_id)
                if len(found) == num:
                    break
        return found

    def num_evictable(self) -> int:
        now = self.clock()
        self.expire_pins(now)
        return len(self._evictable(len(self.free_queue), now))

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
        if self.min_residency_s:
            self.resident_until[block_id] = self.clock() + self.min_residency_s
        pin = self.pins.get(key)
        if pin is not None and pin.block_id is None:
            pin.block_id = block_id
            self.ref_count[block_id] += 1
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
        self.resident_until[block_id] = 0.0
        self.free_queue.remove(block_id)
        self.free_queue.push_front(block_id)
        return True

    def pin(self, keys: Iterable[BlockKey], ttl_s: float) -> list[BlockKey]:
        """Keep `keys` from eviction for `ttl_s` seconds (extending, never shortening, a pin).

        A key not cached yet is pinned as soon as it is committed. Returns the
        keys whose blocks are held now.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        return self.pin_until(keys, self.clock() + ttl_s)

    def pin_until(self, keys: Iterable[BlockKey], expires_at: float) -> list[BlockKey]:
        """pin() with an absolute deadline on the pool's clock."""
        for key in keys:
            pin = self.pins.get(key)
            if pin is None:
                block_id = self.index.get(key)
                if block_id is not None:
                    self.touch([block_id])
                self.pins[key] = Pin(expires_at, block_id)
            elif pin.expires_at < expires_at:
                pin.expires_at = expires_at
            heapq.heappush(self._pin_deadlines, (expires_at, key))
        return [key for key, pin in self.pins.items() if pin.block_id is not None]

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Release pins now; their blocks join the free queue once no request holds them."""
        for key in keys:
            pin = self.pins.pop(key, None)
            if pin is not None and pin.block_id is not None:
                self.free([pin.block_id])

    def expire_pins(self, now: float | None = None) -> list[BlockKey]:
        """Release every pin whose TTL has passed; returns their keys."""
        now = self.clock() if now is None else now
        expired: list[BlockKey] = []
        deadlines = self._pin_deadlines
        while deadlines and deadlines[0][0] <= now:
            _, key = heapq.heappop(deadlines)
            pin = self.pins.get(key)
            if pin is not None and pin.expires_at <= now:
                self.unpin([key])
                expired.append(key)
        return expired

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
            else:
                assert self.resident_until[block_id] == 0.0, f"keyless block {block_id} is resident"
        assert len(self.index) == sum(k is not None for k in self.key_of), "index has orphans"
        for key, pin in self.pins.items():
            if pin.block_id is not None:
                assert self.index.get(key) == pin.block_id, f"pin on {key.hex()} holds a block that lost it"
                assert self.ref_count[pin.block_id] > 0, f"pinned block {pin.block_id} has no ref"
            else:
                assert key not in self.index, f"pin on cached {key.hex()} holds no block"
