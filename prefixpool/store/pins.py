"""The pinned-prefix registry: named pins with a TTL and automatic soft pins of hot prefixes.

    hard pins  name -> (keys, expires_at)   set by an admin; never evicted until the TTL
    soft pins  the `soft_budget_blocks` most-hit block keys, re-chosen by refresh_soft()

Hit counts are per block key. Because keys are chained, a hit on block i is
also a hit on blocks 0..i-1, so a head's count is never below its tail's:
the top-N keys by count (ties in first-seen order, heads first) are whole
prefixes, and "the top-k most hit prefixes" becomes "the N most hit blocks"
with N a block budget, so soft pins can never take more than the budget.

Every key holds at most one pool pin; its deadline is the latest of the
holders that still want it (each named pin, the soft set), and the pool
releases it lazily once that passes. This registry only says which keys want
a pin until when: prefixpool/store/node_blocks.py applies that to the pool. Knows
nothing of the pool, tiers, etcd or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from prefixpool.store.keys import BlockKey


@dataclass(frozen=True, slots=True)
class NamedPin:
    keys: tuple[BlockKey, ...]
    expires_at: float


@dataclass(frozen=True, slots=True)
class SoftPinChange:
    pinned: list[BlockKey] = field(default_factory=list)
    unpinned: list[BlockKey] = field(default_factory=list)


class PrefixPins:
    def __init__(self, soft_budget_blocks: int = 0, soft_ttl_s: float = 300.0, max_tracked: int = 65536) -> None:
        if soft_budget_blocks < 0 or soft_ttl_s <= 0 or max_tracked < 2:
            raise ValueError("soft_budget_blocks >= 0, soft_ttl_s > 0 and max_tracked >= 2 are required")
        self.soft_budget_blocks = soft_budget_blocks
        self.soft_ttl_s = soft_ttl_s
        self.max_tracked = max_tracked
        self.named: dict[str, NamedPin] = {}
        self.hits: dict[BlockKey, int] = {}
        self.soft: set[BlockKey] = set()
        self.soft_expires_at = 0.0

    def pin(self, name: str, keys: Sequence[BlockKey], expires_at: float) -> set[BlockKey]:
        """Pin a prefix under `name` until `expires_at` (replacing an earlier pin of that name); keys to reconcile."""
        old = self.named.pop(name, None)
        self.named[name] = NamedPin(tuple(keys), expires_at)
        return set(keys) | set(old.keys if old else ())

    def unpin(self, name: str) -> set[BlockKey] | None:
        """Forget a named pin; the keys to reconcile, or None if no pin had that name."""
        old = self.named.pop(name, None)
        return None if old is None else set(old.keys)

    def live_names(self, now: float) -> dict[str, NamedPin]:
        """Named pins whose TTL has not passed (expired ones are forgotten here)."""
        for name in [n for n, pin in self.named.items() if pin.expires_at <= now]:
            del self.named[name]
        return dict(self.named)

    def record_hits(self, keys: Iterable[BlockKey]) -> None:
        """Count one hit on each key of a request's matched prefix."""
        hits = self.hits
        for key in keys:
            hits[key] = hits.get(key, 0) + 1
        if len(hits) > self.max_tracked:
            self._age()

    def _age(self) -> None:
        """Keep the hotter half and halve every count, so old heat fades."""
        ranked = self._ranked()[: self.max_tracked // 2]
        self.hits = {key: count // 2 or 1 for key, count in ranked}

    def _ranked(self) -> list[tuple[BlockKey, int]]:
        # sorted() is stable: equal counts keep first-seen order, heads before tails
        return sorted(self.hits.items(), key=lambda item: -item[1])

    def refresh_soft(self, now: float) -> tuple[SoftPinChange, set[BlockKey]]:
        """Soft-pin the most-hit blocks up to the budget for another soft TTL; the change and the keys to reconcile."""
        chosen = {key for key, _ in self._ranked()[: self.soft_budget_blocks]}
        change = SoftPinChange(sorted(chosen - self.soft), sorted(self.soft - chosen))
        touched = chosen | self.soft
        self.soft = chosen
        self.soft_expires_at = now + self.soft_ttl_s
        return change, touched

    def deadline(self, key: BlockKey, now: float) -> float | None:
        """The latest time a holder still wants `key` pinned, or None when none does."""
        times = [pin.expires_at for pin in self.named.values() if key in pin.keys and pin.expires_at > now]
        if key in self.soft and self.soft_expires_at > now:
            times.append(self.soft_expires_at)
        return max(times, default=None)
