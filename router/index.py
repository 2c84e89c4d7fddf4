"""The cluster-wide block index: which nodes hold which block key, in which tier.

    holders[key] = {node_id: tier, ...}        keys_of[node_id] = {key, ...}

A plain data structure. The router's etcd mirror feeds it from watch events,
the trace simulator feeds it directly; both ask `longest_prefix`. Knows
nothing of etcd, HTTP or how keys were made.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from store.keys import BlockKey
from store.tier_names import DEVICE


class BlockIndex:
    def __init__(self) -> None:
        self.holders: dict[BlockKey, dict[str, str]] = {}
        self.keys_of: dict[str, set[BlockKey]] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def add(self, node_id: str, keys: Iterable[BlockKey], tier: str = DEVICE) -> None:
        held = self.keys_of.setdefault(node_id, set())
        for key in keys:
            self.holders.setdefault(key, {})[node_id] = tier
            held.add(key)

    def remove(self, node_id: str, keys: Iterable[BlockKey]) -> None:
        held = self.keys_of.get(node_id)
        if held is None:
            return
        for key in keys:
            if key in held:
                held.discard(key)
                nodes = self.holders[key]
                del nodes[node_id]
                if not nodes:
                    del self.holders[key]

    def remove_node(self, node_id: str) -> None:
        self.remove(node_id, list(self.keys_of.get(node_id, ())))
        self.keys_of.pop(node_id, None)

    def tier_of(self, node_id: str, key: BlockKey) -> str | None:
        return self.holders.get(key, {}).get(node_id)

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Per node, how many keys from keys[0] on it holds consecutively (nodes with 0 omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] = set()
        for position, key in enumerate(keys):
            nodes = self.holders.get(key, {})
            now = set(nodes) if position == 0 else alive.intersection(nodes)
            for node_id in alive - now:
                matched[node_id] = position
            alive = now
            if not alive:
                return matched
        for node_id in alive:
            matched[node_id] = len(keys)
        return matched

    def check_integrity(self) -> None:
        for key, nodes in self.holders.items():
            assert nodes, f"{key.hex()} has no holders"
            for node_id in nodes:
                assert key in self.keys_of.get(node_id, ()), f"{node_id} lacks {key.hex()}"
        for node_id, keys in self.keys_of.items():
            for key in keys:
                assert node_id in self.holders.get(key, {}), f"{key.hex()} lacks {node_id}"
