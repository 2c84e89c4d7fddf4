"""The dict-of-dicts block index the router used before prefixpool.meta.index: the "before" column of
scripts/bench_index.py. Not a production path.

Which nodes hold which block key, in which tier:

    holders[key] = {node_id: tier, ...}        keys_of[node_id] = {key, ...}
    num_lower[node_id] = keys it holds in a tier below the device (0 for most: no per-key lookups then)

A plain data structure. The router's etcd mirror feeds it from watch events,
the trace simulator feeds it directly; both ask `longest_prefix`. Knows
nothing of etcd, HTTP or how keys were made.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Iterable, Sequence

from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import DEVICE


class DictBlockIndex:
    def __init__(self) -> None:
        self.holders: dict[BlockKey, dict[str, str]] = {}
        self.keys_of: dict[str, set[BlockKey]] = {}
        self.num_lower: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def num_blocks(self, node_id: str) -> int:
        return len(self.keys_of.get(node_id, ()))

    def add(self, node_id: str, keys: Iterable[BlockKey], tier: str = DEVICE) -> None:
        held = self.keys_of.setdefault(node_id, set())
        lower = self.num_lower.get(node_id, 0)
        for key in keys:
            nodes = self.holders.setdefault(key, {})
            lower += (tier != DEVICE) - (nodes.get(node_id, DEVICE) != DEVICE)
            nodes[node_id] = tier
            held.add(key)
        self.num_lower[node_id] = lower

    def remove(self, node_id: str, keys: Iterable[BlockKey]) -> None:
        held = self.keys_of.get(node_id)
        if held is None:
            return
        for key in keys:
            if key in held:
                held.discard(key)
                nodes = self.holders[key]
                if nodes.pop(node_id) != DEVICE:
                    self.num_lower[node_id] -= 1
                if not nodes:
                    del self.holders[key]

    def remove_node(self, node_id: str) -> None:
        self.remove(node_id, list(self.keys_of.get(node_id, ())))
        self.keys_of.pop(node_id, None)
        self.num_lower.pop(node_id, None)

    def tier_of(self, node_id: str, key: BlockKey) -> str | None:
        return self.holders.get(key, {}).get(node_id)

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        """{tier: count} of `keys` that `node_id` holds below the device; {} at once when it holds none there."""
        counts: dict[str, int] = {}
        if not self.num_lower.get(node_id):
            return counts
        for key in keys:
            tier = self.holders.get(key, {}).get(node_id)
            if tier is not None and tier != DEVICE:
                counts[tier] = counts.get(tier, 0) + 1
        return counts

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Per node, how many keys from keys[0] on it holds consecutively (nodes with 0 omitted).

        Only holders of keys[0] can match; per holder, one C-speed walk (takewhile over the
        set's membership test) that stops at its first miss, instead of a Python step per key.
        """
        if not keys:
            return {}
        return {node_id: len(list(takewhile(self.keys_of[node_id].__contains__, keys)))
                for node_id in self.holders.get(keys[0], ())}

    def check_integrity(self) -> None:
        for key, nodes in self.holders.items():
            assert nodes, f"{key.hex()} has no holders"
            for node_id in nodes:
                assert key in self.keys_of.get(node_id, ()), f"{node_id} lacks {key.hex()}"
        for node_id, keys in self.keys_of.items():
            for key in keys:
                assert node_id in self.holders.get(key, {}), f"{key.hex()} lacks {node_id}"
            lower = sum(1 for key in keys if self.holders[key][node_id] != DEVICE)
            assert self.num_lower.get(node_id, 0) == lower, (
                f"{node_id}: num_lower {self.num_lower.get(node_id)} != {lower}")
