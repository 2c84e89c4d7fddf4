"""Speculative entries: blocks a router just sent to a node, counted as held there before its KV events say so.

    add(node, keys, now)        routed: node holds keys (until now + ttl_s)
    extend(keys, matches)       each node's index match, continued through its speculative keys
    confirm(node, keys)         the index now shows them: the entries are no longer needed
    expire(now)                 entries past their TTL go (the request failed, or its events never came)
    num_pending(node)           blocks counted as held there and not yet confirmed
    snapshot()                  node -> keys, published with the router's load so other routers count them too

A burst of requests for a new prefix arrives faster than the node that computes it can publish its
blocks: without these entries every request of the burst sees an empty index and the policy spreads
them, making a copy of the prefix on every node. sglang-router counts a routed prefix as cached at once
(its radix tree); these entries do the same for the time the real KV events take, then yield to them.

Expiry order, oldest first (the TTL is one constant, so the queue is already sorted):

    _order:  (t0, a, k1) (t0, a, k2) (t1, b, k1) ...  ─▶ popped while expires_at <= now;
             a key confirmed and added again since holds a newer time and survives the old one's pop
Knows nothing of policies, etcd or HTTP.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from prefixpool.store.keys import BlockKey


class SpeculativeBlocks:
    def __init__(self, ttl_s: float = 5.0) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self._holders: dict[BlockKey, dict[str, float]] = {}  # key -> {node: expires_at}
        self._counts: dict[str, int] = {}
        self._order: deque[tuple[float, str, BlockKey]] = deque()

    def add(self, node: str, keys: Iterable[BlockKey], now: float) -> None:
        """Entries already pending keep their first expiry: a claim that routing renewed would outlive the
        blocks it names (a node evicts them, its events say so, and each request sent there on the strength
        of the claim would renew it: measured, one vLLM server took 92% of the work and thrashed)."""
        expires_at = now + self.ttl_s
        for key in keys:
            nodes = self._holders.setdefault(key, {})
            if node not in nodes:
                self._counts[node] = self._counts.get(node, 0) + 1
                nodes[node] = expires_at
                self._order.append((expires_at, node, key))

    def extend(self, keys: Sequence[BlockKey], matches: dict[str, int]) -> dict[str, int]:
        """`matches` (node -> keys[0..n) held by the index) with each node's run continued through the keys
        it holds speculatively; a node the index does not name counts from keys[0]."""
        merged = dict(matches)
        nodes = set(self._holders.get(keys[0], ())) if keys else set()
        nodes.update(n for n in matches if self._counts.get(n))
        for node in nodes:
            n = matches.get(node, 0)
            while n < len(keys) and node in self._holders.get(keys[n], ()):
                n += 1
            if n:
                merged[node] = n
        return merged

    def confirm(self, node: str, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._drop(node, key)

    def expire(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            expires_at, node, key = self._order.popleft()
            if self._holders.get(key, {}).get(node) == expires_at:  # not refreshed by a later add
                self._drop(node, key)

    def snapshot(self) -> dict[str, list[BlockKey]]:
        """node -> its speculative keys: what this router publishes for the others (prefixpool.meta.fleet_load)."""
        held: dict[str, list[BlockKey]] = {}
        for key, nodes in self._holders.items():
            for node in nodes:
                held.setdefault(node, []).append(key)
        return held

    def num_pending(self, node: str) -> int:
        return self._counts.get(node, 0)

    def __len__(self) -> int:
        return sum(self._counts.values())

    def _drop(self, node: str, key: BlockKey) -> None:
        nodes = self._holders.get(key)
        if nodes is None or nodes.pop(node, None) is None:
            return
        self._counts[node] -= 1
        if not nodes:
            del self._holders[key]

    def check_integrity(self) -> None:
        counts: dict[str, int] = {}
        for key, nodes in self._holders.items():
            assert nodes, f"{key.hex()} has no holders"
            for node in nodes:
                counts[node] = counts.get(node, 0) + 1
        assert {n: c for n, c in self._counts.items() if c} == counts, (self._counts, counts)
        assert len(self._order) >= len(self), "an entry without its place in the expiry queue"
