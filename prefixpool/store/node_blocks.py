"""One node's blocks: the pool, the tiers under it and the pins, behind request-level holds.

This is the one module that changes ref counts (through the pool's touch,
free, allocate, commit and pin): every other part holds blocks through it.

    hold = blocks.acquire(keys)       the cached device prefix of `keys`, held (ref_count += 1)
    blocks.allocate(hold, n)          n fresh blocks appended to the hold; what they evicted
                                      went down a tier first; returns the evicted keys
    blocks.commit(hold, i, keys)      hold.block_ids[i:] now answer for `keys`; returns those stored
    blocks.adopt(hold, i, key)        a key a twin already answers for: hold the twin instead
    blocks.release(hold, keep=0)      free the hold's blocks after the first `keep`, tail first
    blocks.promote(keys)              lift the host/SSD run after the device prefix into device blocks
    blocks.clear()                    forget every block nobody holds, in every tier (stale KV: new weights)
    blocks.pin / unpin / refresh_soft TTL pins from the registry (prefixpool/store/pins.py), applied to the pool
    blocks.checksums                  committed blocks' payload checksums (prefixpool/store/checksums.py),
                                      forgotten here whenever a block is allocated to be written

    who holds        engine: one hold per admitted request, until it finishes
                     transfer source: one per fetch served, while its records stream out
                     transfer sink: one per fetch received; the committed prefix goes to the caller
                     worker: what it fetched and promoted for a request, until the request ends
                     pins: one pool pin per pinned key, until its deadline

check_integrity() recounts every block's refs from the open holds and the
pool's pins, and checks the pool, the tiers and the pins against each other.
Every tier change (with lower tiers) is also kept in a journal the worker
takes with take_changes() and publishes; the device-only null tiers record
nothing. One thread only (the worker's event loop). Knows nothing of etcd,
the network, the engine or tensors beyond what the tiers copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from prefixpool.store.checksums import BlockChecksums
from prefixpool.store.keys import BlockKey
from prefixpool.store.pins import NamedPin, PrefixPins, SoftPinChange
from prefixpool.store.pool import BlockPool, PoolExhausted
from prefixpool.store.tier_names import DEVICE, DISK
from prefixpool.store.tiers import NoTiers, Source, TierChain, TierChanges, TierHits


@dataclass(eq=False, slots=True)
class Hold:
    """Blocks held for one user (a request, a fetch): prefix hits first, then allocated blocks."""

    block_ids: list[int] = field(default_factory=list)


class NodeBlocks:
    def __init__(self, pool: BlockPool, tiers: TierChain | None = None, pins: PrefixPins | None = None) -> None:
        if tiers is not None:
            assert pool.num_blocks == tiers.arena.num_blocks, "pool and arena disagree on the number of blocks"
        self.pool = pool
        self.tiers: TierChain | NoTiers = NoTiers() if tiers is None else tiers
        self.pins = PrefixPins() if pins is None else pins
        self.checksums = BlockChecksums()
        self._holds: set[Hold] = set()
        self._journal = TierChanges()

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        return self.pool.match(keys)

    def lookup(self, key: BlockKey) -> int | None:
        return self.pool.lookup(key)

    def fits(self, keys: Sequence[BlockKey], num_blocks: int) -> bool:
        """Whether a request of `num_blocks` blocks whose prefix is `keys` has room now (residency aside)."""
        cached = self.pool.match(keys)
        ref_count = self.pool.ref_count
        unheld_hits = sum(1 for block_id in cached if ref_count[block_id] == 0)
        return num_blocks - len(cached) <= self.pool.num_free - unheld_hits

    def tier_hits(self, keys: Sequence[BlockKey]) -> TierHits:
        """How long the run of `keys` is per tier, changing nothing."""
        num_device = len(self.pool.match(keys))
        lower = self.tiers.lookup(keys[num_device:], self.pool.index)
        return TierHits(num_device, lower.host, lower.disk)

    def tier_of(self, key: BlockKey) -> str | None:
        """The fastest tier holding `key` (what the index should advertise)."""
        return DEVICE if key in self.pool.index else self.tiers.tier_of(key)

    def placement(self, keys: Iterable[BlockKey]) -> tuple[dict[str, list[BlockKey]], list[BlockKey]]:
        """({tier: keys held there now}, keys held nowhere): what to put and what to delete."""
        stored: dict[str, list[BlockKey]] = {}
        removed: list[BlockKey] = []
        for key in dict.fromkeys(keys):
            tier = self.tier_of(key)
            if tier is None:
                removed.append(key)
            else:
                stored.setdefault(tier, []).append(key)
        return stored, removed

    def entries(self) -> list[tuple[BlockKey, str]]:
        """Every block held, in its fastest tier (a full re-publish)."""
        device = self.pool.index
        return [(key, DEVICE) for key in list(device)] + [e for e in self.tiers.entries() if e[0] not in device]

    # -- holds -----------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[BlockKey]) -> Hold:
        """Hold the longest cached device prefix of `keys` (possibly nothing)."""
        block_ids = self.pool.match(keys)
        self.pool.touch(block_ids)
        hold = Hold(block_ids)
        self._holds.add(hold)
        return hold

    def allocate(self, hold: Hold, num: int) -> list[BlockKey]:
        """Append `num` fresh blocks to the hold, all or nothing (PoolExhausted); the keys evicted."""
        assert hold in self._holds, "allocate into a released hold"
        alloc = self.pool.allocate(num)
        self.checksums.forget(alloc.block_ids)
        if alloc.evicted:
            self.tiers.demote(alloc, self._journal)
        hold.block_ids.extend(alloc.block_ids)
        return alloc.evicted

    def commit(self, hold: Hold, start: int, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The hold's fully written blocks from `start` on answer for `keys`; returns the keys stored.

        A key another block already answers for is not stored: its block here stays keyless.
        """
        assert start + len(keys) <= len(hold.block_ids), "commit past the hold's blocks"
        commit = self.pool.commit
        block_ids = hold.block_ids[start : start + len(keys)]  # not [start:]: a fetch commits block by block
        return [key for block_id, key in zip(block_ids, keys) if commit(block_id, key)]

    def adopt(self, hold: Hold, index: int, key: BlockKey) -> None:
        """After a refused commit: hold the block that answers for `key` instead of block `index`."""
        twin = self.pool.lookup(key)
        assert twin is not None, "adopt of a key with no block"
        self.pool.touch([twin])
        self.pool.free([hold.block_ids[index]])
        hold.block_ids[index] = twin

    def release(self, hold: Hold, keep: int = 0) -> None:
        """Free the hold's blocks after the first `keep`, tail first; keep=0 ends the hold."""
        if keep:
            self.pool.free(hold.block_ids[keep:])
            del hold.block_ids[keep:]
            return
        self.pool.free(hold.block_ids)
        hold.block_ids = []
        self._holds.discard(hold)

    # -- tiers -----------------------------------------------------------------------------------
    def promote(self, keys: Sequence[BlockKey]) -> TierChanges:
        """Bring the lower-tier run after the device prefix of `keys` up to the device, unheld.

        Promotes as many blocks as the pool can give (fewer under pressure,
        none when every free block is held or resident). A corrupt SSD block
        ends the run: it is a miss, never wrong KV.
        """
        changes = TierChanges()
        device = self.pool.match(keys)
        sources = self.tiers.run(keys[len(device):], self.pool.index)
        if sources:
            self.pool.touch(device)  # the prefix being extended must not be evicted to make room
            try:
                self._lift(sources, changes)
            finally:
                self.pool.free(device)
            self._journal.extend(changes)
        return changes

    def _lift(self, sources: list[Source], changes: TierChanges) -> None:
        try:
            alloc = self.pool.allocate(len(sources))
        except PoolExhausted as err:
            if err.available == 0:
                return
            alloc = self.pool.allocate(err.available)
        self.checksums.forget(alloc.block_ids)
        victims = self.tiers.stage(alloc)
        for block_id, source in zip(alloc.block_ids, sources):
            self.tiers.lift(block_id, source, changes)
            assert self.pool.commit(block_id, source[0]), "promoted a key the device already had"
            changes.store(DEVICE, source[0])
        self.tiers.settle(victims, changes)
        self.pool.free(alloc.block_ids)

    def collect(self) -> TierChanges:
        """SSD writes and evictions finished in the background since the last call."""
        changes = self.tiers.collect()
        self._journal.extend(changes)
        return changes

    def scan(self) -> list[BlockKey]:
        """After a restart: index the valid SSD files (journalled for publishing)."""
        found = self.tiers.scan()
        for key in found:
            self._journal.store(DISK, key)
        return found

    def clear(self) -> list[BlockKey]:
        """Forget every block no hold or pin keeps, on the device and in every lower tier; returns the keys."""
        changes = self.tiers.clear()
        for key in self.pool.cached_keys():
            if self.pool.drop(key):
                changes.remove(DEVICE, key)
        self._journal.extend(changes)
        return changes.keys()

    def take_changes(self) -> TierChanges:
        """Every tier change since the last call: demotions, promotions, SSD writes."""
        changes, self._journal = self._journal, TierChanges()
        return changes

    def close(self) -> None:
        self.tiers.close()

    # -- pins ------------------------------------------------------------------------------------
    def pin(self, name: str, keys: Sequence[BlockKey], ttl_s: float) -> list[BlockKey]:
        """Pin a prefix under `name` for `ttl_s` seconds; the keys whose blocks are held now."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        now = self.pool.clock()
        self._reconcile(self.pins.pin(name, keys, now + ttl_s), now)
        pins = self.pool.pins
        return [key for key in keys if key in pins and pins[key].block_id is not None]

    def unpin(self, name: str) -> bool:
        keys = self.pins.unpin(name)
        if keys is None:
            return False
        self._reconcile(keys, self.pool.clock())
        return True

    def refresh_soft(self) -> SoftPinChange:
        now = self.pool.clock()
        change, keys = self.pins.refresh_soft(now)
        self._reconcile(keys, now)
        return change

    def live_names(self) -> dict[str, NamedPin]:
        return self.pins.live_names(self.pool.clock())

    def expire_pins(self) -> list[BlockKey]:
        return self.pool.expire_pins()

    def _reconcile(self, keys: Iterable[BlockKey], now: float) -> None:
        """Give each key exactly the pool pin its remaining holders want."""
        for key in keys:
            deadline = self.pins.deadline(key, now)
            current = self.pool.pins.get(key)
            if deadline is None:
                self.pool.unpin([key])
            elif current is None or current.expires_at != deadline:
                if current is not None and current.expires_at > deadline:
                    self.pool.unpin([key])  # shorten: drop the longer pin first
                self.pool.pin_until([key], deadline)

    # -- integrity -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless pool, tiers, pins and holds agree."""
        pool = self.pool
        pool.check_integrity()
        self.tiers.check_integrity()
        expected = [0] * pool.num_blocks
        for hold in self._holds:
            for block_id in hold.block_ids:
                expected[block_id] += 1
        for pin in pool.pins.values():
            if pin.block_id is not None:
                expected[pin.block_id] += 1
        for block_id, (want, have) in enumerate(zip(expected, pool.ref_count)):
            assert want == have, f"block {block_id}: ref_count {have}, holds and pins account for {want}"
            assert block_id not in self.checksums or pool.key_of[block_id] is not None, \
                f"block {block_id} has a checksum but no key: it was never committed"
        now = pool.clock()
        for key, pin in pool.pins.items():
            if pin.expires_at > now:
                assert self.pins.deadline(key, now) == pin.expires_at, f"pool pin on {key.hex()} nobody wants"
        wanted = {key for pin in self.pins.named.values() if pin.expires_at > now for key in pin.keys}
        if self.pins.soft_expires_at > now:
            wanted |= self.pins.soft
        for key in wanted:
            assert key in pool.pins and pool.pins[key].expires_at == self.pins.deadline(key, now), \
                f"{key.hex()} is wanted pinned but the pool does not hold it so"
