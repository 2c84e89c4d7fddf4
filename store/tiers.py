"""The tier chain under one node's pool: device -> host memory -> local SSD.

    allocate(n)    device blocks; each evicted block's bytes go down to host
                   BEFORE the block is handed out (host's own victims go to SSD)
    promote(keys)  extend the device prefix of `keys` with the run found in host
                   or SSD: copy those bytes into fresh device blocks and commit
                   them, so a following pool.match(keys) hits them
    lookup(keys)   how long that run is per tier, changing nothing

    keys:   k0  k1  k2 | k3  k4 | k5 | k6
            device     | host   | ssd| miss      lookup -> TierHits(3, 2, 1)

Host is exclusive of the device (promotion moves a block up); the SSD keeps
its copy (rewriting a block is the expensive part). A tier of size 0 is not
constructed: the chain holds only the tiers that exist. Every call returns
what it changed per tier; SSD writes finish later and are collected with
`collect()`. Knows nothing of etcd, the network or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from store.arena import KVArena
from store.disk_tier import DiskTier
from store.host_tier import HostTier, as_uint8
from store.keys import BlockKey
from store.pool import Allocation, BlockPool, PoolExhausted
from store.tier_names import DEVICE


class LowerTier(Protocol):
    """What the chain needs of a tier below the device (victim/view only when full() can be True)."""

    name: str

    def __contains__(self, key: BlockKey) -> bool: ...
    def full(self) -> bool: ...
    def victim(self) -> BlockKey: ...
    def view(self, key: BlockKey) -> torch.Tensor: ...
    def put(self, key: BlockKey, payload: torch.Tensor | memoryview | bytes) -> bool: ...
    def remove(self, key: BlockKey) -> bool: ...


@dataclass(slots=True)
class TierChanges:
    """Keys stored in and removed from each tier, by tier name: what to publish."""

    stored: dict[str, list[BlockKey]] = field(default_factory=dict)
    removed: dict[str, list[BlockKey]] = field(default_factory=dict)

    def store(self, tier: str, key: BlockKey) -> None:
        self.stored.setdefault(tier, []).append(key)

    def remove(self, tier: str, key: BlockKey) -> None:
        self.removed.setdefault(tier, []).append(key)

    def __bool__(self) -> bool:
        return any(self.stored.values()) or any(self.removed.values())


@dataclass(frozen=True, slots=True)
class TierHits:
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


class TieredPool:
    def __init__(self, pool: BlockPool, arena: KVArena, host: HostTier | None = None, disk: DiskTier | None = None):
        assert pool.num_blocks == arena.num_blocks, "pool and arena disagree on the number of blocks"
        self.pool = pool
        self.arena = arena
        self.host = host
        self.disk = disk
        self.lower: list[LowerTier] = [tier for tier in (host, disk) if tier is not None]
        self._staging = torch.empty((0, arena.block_bytes), dtype=torch.uint8)  # grows to the largest promotion

    def allocate(self, num: int) -> tuple[Allocation, TierChanges]:
        """pool.allocate, with every evicted block demoted before its block is reused."""
        alloc = self.pool.allocate(num)
        changes = TierChanges()
        for key, block_id in zip(alloc.evicted, alloc.evicted_block_ids):
            changes.remove(DEVICE, key)
            self._demote(0, key, self._block(block_id), changes)
        return alloc, changes

    def lookup(self, keys: Sequence[BlockKey]) -> TierHits:
        num_device = len(self.pool.match(keys))
        host = disk = 0
        for key in keys[num_device:]:
            if key in self.pool.index:
                break
            if self.host is not None and key in self.host:
                host += 1
            elif self.disk is not None and key in self.disk:
                disk += 1
            else:
                break
        return TierHits(num_device, host, disk)

    def promote(self, keys: Sequence[BlockKey]) -> TierChanges:
        """Bring the lower-tier run after the device prefix of `keys` up to the device.

        Promotes as many blocks as the pool can give (fewer under pressure,
        none when every free block is pinned or resident). A corrupt SSD
        block ends the run: it is a miss, never wrong KV.
        """
        changes = TierChanges()
        device = self.pool.match(keys)
        self.pool.touch(device)  # the prefix being extended must not be evicted to make room
        try:
            sources = self._lower_run(keys[len(device) :])
            if sources:
                self._copy_up(sources, changes)
        finally:
            self.pool.free(device)
        return changes

    def collect(self) -> TierChanges:
        """SSD writes and evictions finished since the last call."""
        changes = TierChanges()
        if self.disk is not None:
            stored, removed = self.disk.take_changes()
            for key in stored:
                changes.store(DiskTier.name, key)
            for key in removed:
                changes.remove(DiskTier.name, key)
        return changes

    def tier_of(self, key: BlockKey) -> str | None:
        """The fastest tier holding `key` (what the index should advertise)."""
        if key in self.pool.index:
            return DEVICE
        return next((tier.name for tier in self.lower if key in tier), None)

    def _block(self, block_id: int) -> torch.Tensor:
        return self.arena.view(block_id).reshape(-1).view(torch.uint8)

    def _lower_run(self, keys: Sequence[BlockKey]) -> list[tuple[BlockKey, str, torch.Tensor]]:
        """Sources of the run: host views, verified SSD payloads (a bad file ends it; collect() reports it)."""
        run: list[tuple[BlockKey, str, torch.Tensor]] = []
        for key in keys:
            if key in self.pool.index:
                break
            if self.host is not None and key in self.host:
                run.append((key, HostTier.name, self.host.view(key)))
                continue
            payload = self.disk.read(key) if self.disk is not None else None
            if payload is None:
                break
            run.append((key, DiskTier.name, as_uint8(payload)))
        return run

    def _copy_up(self, sources: list[tuple[BlockKey, str, torch.Tensor]], changes: TierChanges) -> None:
        try:
            alloc = self.pool.allocate(len(sources))
        except PoolExhausted as err:
            if err.available == 0:
                return
            alloc = self.pool.allocate(err.available)
        victims = self._stage(alloc)
        for block_id, (key, tier, payload) in zip(alloc.block_ids, sources):
            self._block(block_id).copy_(payload, non_blocking=payload.is_pinned())
            assert self.pool.commit(block_id, key), "promoted a key the device already had"
            changes.store(DEVICE, key)
            if tier == HostTier.name:
                self.host.remove(key)
                changes.remove(HostTier.name, key)
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)  # host slots are reused below
        for key, payload in victims:
            changes.remove(DEVICE, key)
            self._demote(0, key, payload, changes)
        self.pool.free(alloc.block_ids)

    def _stage(self, alloc: Allocation) -> list[tuple[BlockKey, torch.Tensor]]:
        """Copy the evicted blocks' bytes aside: their blocks are about to be overwritten."""
        num = len(alloc.evicted)
        if num > len(self._staging):
            self._staging = torch.zeros((num, self.arena.block_bytes), dtype=torch.uint8, pin_memory=_pinned())
        for row, block_id in enumerate(alloc.evicted_block_ids):
            self._staging[row].copy_(self._block(block_id))
        return list(zip(alloc.evicted, self._staging[:num]))

    def _demote(self, level: int, key: BlockKey, payload: torch.Tensor, changes: TierChanges) -> None:
        """Put a block into tier `level`, first pushing that tier's victims one level down."""
        if level == len(self.lower):
            return
        tier = self.lower[level]
        while key not in tier and tier.full():
            victim = tier.victim()
            self._demote(level + 1, victim, tier.view(victim), changes)
            tier.remove(victim)
            changes.remove(tier.name, victim)
        if tier.put(key, payload):
            changes.store(tier.name, key)


def _pinned() -> bool:
    return torch.cuda.is_available()
