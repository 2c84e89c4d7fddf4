"""The worker's view of its tier chain: allocate, promote, collect, and what to publish where.

    NodeTiers(TieredPool)   device -> host -> SSD; every call notes the keys it touched
    DeviceOnly(pool)        the null object when no lower tier is configured

Publishing is by key, not by event: a node advertises each block once, in
the fastest tier holding it (etcd's `/blocks/<key>/<node>` has one value), so
for every key touched since the last publish the worker asks `tier_of` and
puts that tier, or deletes the key when no tier holds it. Order of events
no longer matters (evicted from device and demoted to host -> "host").

    evicted device block, demoted        -> stored "host"   (was "device")
    host victim pushed to SSD, written   -> stored "disk"   (collect(), later)
    promoted from host                   -> stored "device"
    corrupt SSD file found on read       -> removed

Knows nothing of etcd or HTTP: the worker publishes what `take_touched` gives.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

from store.keys import BlockKey
from store.pool import Allocation, BlockPool
from store.tiers import DEVICE, TierChanges, TieredPool


class DeviceOnly:
    """No lower tier: allocation is the pool's, nothing is promoted or collected."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def allocate(self, num: int) -> Allocation:
        return self.pool.allocate(num)

    def promote(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        return []

    def collect(self) -> None:
        pass

    def scan(self) -> list[BlockKey]:
        return []

    def take_touched(self) -> list[BlockKey]:
        return []

    def tier_of(self, key: BlockKey) -> str | None:
        return DEVICE if key in self.pool.index else None

    def entries(self) -> list[tuple[BlockKey, str]]:
        return [(key, DEVICE) for key in self.pool.cached_keys()]

    def close(self) -> None:
        pass


class NodeTiers:
    """A TieredPool that remembers which keys changed tier, for the next publish."""

    def __init__(self, tiers: TieredPool) -> None:
        self.tiers = tiers
        self.pool = tiers.pool
        self._touched: dict[BlockKey, None] = {}

    def allocate(self, num: int) -> Allocation:
        allocation, changes = self.tiers.allocate(num)
        self._note(changes)
        return allocation

    def promote(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Keys copied up into committed device blocks (unpinned: the caller pins what it needs)."""
        changes = self.tiers.promote(keys)
        self._note(changes)
        return changes.stored.get(DEVICE, [])

    def collect(self) -> None:
        """Note the SSD writes and evictions that finished in the background."""
        self._note(self.tiers.collect())

    def scan(self) -> list[BlockKey]:
        """After a restart: index the valid SSD files, note them for publishing."""
        if self.tiers.disk is None:
            return []
        found = self.tiers.disk.scan()
        self._touch(found)
        return found

    def take_touched(self) -> list[BlockKey]:
        touched, self._touched = self._touched, {}
        return list(touched)

    def tier_of(self, key: BlockKey) -> str | None:
        return self.tiers.tier_of(key)

    def entries(self) -> list[tuple[BlockKey, str]]:
        """Every block held, in its fastest tier (a full re-publish)."""
        seen = set(self.pool.cached_keys())
        out = [(key, DEVICE) for key in seen]
        for tier in self.tiers.lower:
            for key in list(tier.index):  # list() of a dict is one C call: safe against the SSD writer thread
                if key not in seen:
                    seen.add(key)
                    out.append((key, tier.name))
        return out

    def close(self) -> None:
        if self.tiers.disk is not None:
            self.tiers.disk.close()

    def _note(self, changes: TierChanges) -> None:
        for keys in (*changes.stored.values(), *changes.removed.values()):
            self._touch(keys)

    def _touch(self, keys: Iterable[BlockKey]) -> None:
        self._touched.update(dict.fromkeys(keys))


def by_tier(tiers: DeviceOnly | NodeTiers, keys: Iterable[BlockKey]) -> tuple[dict[str, list[BlockKey]], list[BlockKey]]:
    """({tier: keys held there now}, keys held nowhere): what to put and what to delete."""
    stored: dict[str, list[BlockKey]] = defaultdict(list)
    removed: list[BlockKey] = []
    for key in dict.fromkeys(keys):
        tier = tiers.tier_of(key)
        if tier is None:
            removed.append(key)
        else:
            stored[tier].append(key)
    return dict(stored), removed
