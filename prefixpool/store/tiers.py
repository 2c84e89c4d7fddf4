"""The tiers under one node's device blocks: host memory, then the local SSD; bytes only.

    demote(evicted)   an evicted device block's bytes go down to host BEFORE its
                      block is handed out (host's own victims go on to SSD)
    run(keys, index)  the lower-tier run after a device prefix: (key, tier, bytes)
    lift(...)         copy one block of that run into a device block
    lookup / tier_of  where keys sit below the device, changing nothing

    keys:   k0  k1  k2 | k3  k4 | k5 | k6
            device     | host   | ssd| miss      run(keys[3:]) -> k3, k4 (host), k5 (ssd)

A lifted block leaves host (host stays exclusive of what promotion brings up); the SSD keeps
its copy (rewriting a block is the expensive part). A tier of size 0 is not
constructed, and a node with no lower tier gets `NoTiers`, the null object.
Every call records what it changed per tier in the caller's `TierChanges`;
SSD writes finish later and are collected with `collect()`. Which device
block holds what, and every ref count, belong to prefixpool/store/node_blocks.py: this
module knows nothing of the pool, etcd, the network or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch

from prefixpool.store.arena import KVArena
from prefixpool.store.disk_tier import DiskTier
from prefixpool.store.host_tier import HostTier, as_uint8
from prefixpool.store.keys import BlockKey
from prefixpool.store.pool import Allocation
from prefixpool.store.tier_names import DEVICE, HOST

Source = tuple[BlockKey, str, torch.Tensor]  # key, the tier it sits in, its bytes


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

    def extend(self, other: TierChanges) -> None:
        for tier, keys in other.stored.items():
            self.stored.setdefault(tier, []).extend(keys)
        for tier, keys in other.removed.items():
            self.removed.setdefault(tier, []).extend(keys)

    def keys(self) -> list[BlockKey]:
        """Every key whose tier changed, once each."""
        touched = {key: None for keys in self.stored.values() for key in keys}
        touched.update((key, None) for keys in self.removed.values() for key in keys)
        return list(touched)

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


class NoTiers:
    """No tier below the device: nothing is demoted, lifted, collected or scanned."""

    host = disk = None
    lower: list[LowerTier] = []

    def demote(self, alloc: Allocation, changes: TierChanges) -> None:
        pass

    def run(self, keys: Sequence[BlockKey], device: Mapping[BlockKey, int]) -> list[Source]:
        return []

    def lookup(self, keys: Sequence[BlockKey], device: Mapping[BlockKey, int]) -> TierHits:
        return TierHits()

    def tier_of(self, key: BlockKey) -> str | None:
        return None

    def entries(self) -> list[tuple[BlockKey, str]]:
        return []

    def collect(self) -> TierChanges:
        return TierChanges()

    def scan(self) -> list[BlockKey]:
        return []

    def check_integrity(self) -> None:
        pass

    def clear(self) -> TierChanges:
        return TierChanges()

    def close(self) -> None:
        pass


class TierChain:
    """Host and/or SSD under a device arena; at least one of them exists."""

    def __init__(self, arena: KVArena, host: HostTier | None = None, disk: DiskTier | None = None) -> None:
        self.arena = arena
        self.host = host
        self.disk = disk
        self.lower: list[LowerTier] = [tier for tier in (host, disk) if tier is not None]
        assert self.lower, "no lower tier: use NoTiers"
        self._staging = torch.empty((0, arena.block_bytes), dtype=torch.uint8)  # grows to the largest lift

    def demote(self, alloc: Allocation, changes: TierChanges) -> None:
        """Copy every block `alloc` evicted down, before the caller overwrites it."""
        for key, block_id in zip(alloc.evicted, alloc.evicted_block_ids):
            changes.remove(DEVICE, key)
            self._demote(0, key, self.block(block_id), changes)

    def run(self, keys: Sequence[BlockKey], device: Mapping[BlockKey, int]) -> list[Source]:
        """Sources of the run: host views, verified SSD payloads (a bad file ends it; collect() reports it)."""
        found: list[Source] = []
        for key in keys:
            if key in device:
                break
            if self.host is not None and key in self.host:
                found.append((key, HOST, self.host.view(key)))
                continue
            payload = self.disk.read(key) if self.disk is not None else None
            if payload is None:
                break
            found.append((key, DiskTier.name, as_uint8(payload)))
        return found

    def stage(self, alloc: Allocation) -> list[tuple[BlockKey, torch.Tensor]]:
        """Copy the evicted blocks' bytes aside: their blocks are about to be overwritten."""
        num = len(alloc.evicted)
        if num > len(self._staging):
            self._staging = torch.zeros((num, self.arena.block_bytes), dtype=torch.uint8, pin_memory=_pinned())
        for row, block_id in enumerate(alloc.evicted_block_ids):
            self._staging[row].copy_(self.block(block_id))
        return list(zip(alloc.evicted, self._staging[:num]))

    def lift(self, block_id: int, source: Source, changes: TierChanges) -> None:
        """Copy one run block into device block `block_id`; host gives its copy up."""
        key, tier, payload = source
        self.block(block_id).copy_(payload, non_blocking=payload.is_pinned())
        if tier == HOST:
            self.host.remove(key)
            changes.remove(HOST, key)

    def settle(self, victims: list[tuple[BlockKey, torch.Tensor]], changes: TierChanges) -> None:
        """After a lift: wait for the copies (host slots are reused), then demote the staged victims."""
        if self.arena.device.type == "cuda":
            torch.cuda.synchronize(self.arena.device)
        for key, payload in victims:
            changes.remove(DEVICE, key)
            self._demote(0, key, payload, changes)

    def lookup(self, keys: Sequence[BlockKey], device: Mapping[BlockKey, int]) -> TierHits:
        """Host and SSD lengths of the run in `keys` (which starts after the device prefix)."""
        host = disk = 0
        for key in keys:
            if key in device:
                break
            if self.host is not None and key in self.host:
                host += 1
            elif self.disk is not None and key in self.disk:
                disk += 1
            else:
                break
        return TierHits(0, host, disk)

    def tier_of(self, key: BlockKey) -> str | None:
        return next((tier.name for tier in self.lower if key in tier), None)

    def entries(self) -> list[tuple[BlockKey, str]]:
        """Every key held below the device, in its fastest lower tier."""
        seen: dict[BlockKey, str] = {}
        for tier in self.lower:
            for key in list(tier.index):  # list() of a dict is one C call: safe against the SSD writer thread
                seen.setdefault(key, tier.name)
        return list(seen.items())

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

    def scan(self) -> list[BlockKey]:
        """After a restart: index the valid SSD files."""
        return self.disk.scan() if self.disk is not None else []

    def clear(self) -> TierChanges:
        """Every block below the device forgotten (SSD files deleted, queued writes landed first)."""
        changes = TierChanges()
        if self.disk is not None:
            self.disk.flush()
        for tier in self.lower:
            for key in list(tier.index):
                tier.remove(key)
                changes.remove(tier.name, key)
        return changes

    def check_integrity(self) -> None:
        # Not checked: host exclusive of the device. A lift keeps it so, but the engine may
        # recompute and commit a block whose stale copy still sits in host (same key, same bytes).
        if self.host is not None:
            self.host.check_integrity()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def block(self, block_id: int) -> torch.Tensor:
        return self.arena.view(block_id).reshape(-1).view(torch.uint8)

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
