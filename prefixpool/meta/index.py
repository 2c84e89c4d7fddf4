"""The cluster-wide block index: which nodes hold which block key, in which tier, in ~20-45 bytes per block.

    node -> (group, bit)          a node is one bit of a 64-bit word; groups of 64 nodes
    groups[g]: BlockTable         fingerprint -> {tier: uint64 bitmap of the group's holders}

        fingerprint    device     host        (a tier's column exists once a node uses it)
        0x9c41...      0b0101     0b0000      nodes 0 and 2 hold it on the device
        0x13e7...      0b0001     0b1000      node 0 on the device, node 3 in host memory

longest_prefix(keys) looks a whole prompt's keys up at once per group (prefixpool.meta.block_table),
ORs the tier columns, and ANDs the words cumulatively: a node's bit stays set for exactly as many
keys from keys[0] on as it holds consecutively, so its match is a count of nonzero words.

Keys are shortened to 64-bit fingerprints (both halves of the 16-byte key folded together), and
two keys sharing one are one entry here. That never gives a wrong answer, only a lost hit:
  - a false "held" (node N holds A, B shares A's fingerprint, a prompt asks for B) makes the router
    send the prompt to N or have N fetch B from a peer; N's own pool matches by the full 16-byte
    key (prefixpool.store.pool), a peer pins only the full keys it holds (transfer.source.pin) and
    the receiver checks each block's full key against the one it asked for (transfer.sink), so the
    block is recomputed: the cost of a miss;
  - a false "gone" (N evicts A while holding B) is a miss too.
The index only ever steers work. With 64-bit fingerprints a table of 5M blocks has a collision
somewhere with probability ~7e-7 (tests/unit/test_index.py forces one).

A plain data structure. The router's etcd mirror feeds it from watch events, the trace simulator
feeds it directly; both ask `longest_prefix` (and, with run-granular publication, `last_held` for
a partial run: prefixpool.meta.runs). Knows nothing of etcd, HTTP or how keys were made.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from prefixpool.meta.block_table import ABSENT, BlockTable, fingerprints
from prefixpool.store.keys import BlockKey
from prefixpool.store.tier_names import DEVICE

GROUP_NODES = 64


class BlockIndex:
    def __init__(self, group_nodes: int = GROUP_NODES) -> None:
        assert 1 <= group_nodes <= 64, group_nodes
        self.group_nodes = group_nodes
        self.groups: list[BlockTable] = []
        self.members: list[dict[int, str]] = []  # per group: bit -> node
        self.slot_of: dict[str, tuple[int, int]] = {}  # node -> (group, bit)
        self.counts: dict[str, dict[str, int]] = {}  # node -> {tier: blocks it holds there}

    def __len__(self) -> int:
        """Blocks with a holder, counted once per group of nodes holding them (exact up to 64 nodes)."""
        return sum(table.num_live for table in self.groups)

    def num_blocks(self, node_id: str) -> int:
        return sum(self.counts.get(node_id, {}).values())

    def num_lower(self, node_id: str) -> int:
        """Blocks `node_id` holds in a tier below the device (0 for most: no per-key lookups then)."""
        return sum(num for tier, num in self.counts.get(node_id, {}).items() if tier != DEVICE)

    def add(self, node_id: str, keys: Iterable[BlockKey], tier: str = DEVICE) -> None:
        """`node_id` holds `keys` in `tier` now (a key it held in another tier moves)."""
        fps = _distinct(fingerprints(list(keys)))
        if not fps.size:
            return
        table, mask = self._slot(node_id)
        slots = table.insert(fps)
        counts = self.counts[node_id]
        for other in [t for t, num in counts.items() if num and t != tier]:
            counts[other] -= table.clear_bits(slots, other, mask)
        counts[tier] = counts.get(tier, 0) + table.set_bits(slots, tier, mask)

    def remove(self, node_id: str, keys: Iterable[BlockKey]) -> None:
        if node_id not in self.slot_of:
            return
        table, _ = self._slot(node_id)
        slots = table.find(_distinct(fingerprints(list(keys))))
        self._clear(node_id, slots[slots != ABSENT])

    def remove_where(self, picked: Callable[[np.ndarray], np.ndarray]) -> None:
        """Every node forgets the blocks whose fingerprints `picked` selects (bool per fingerprint): one
        pass over the tables (an index shard's blocks, block_table.key_words; prefixpool.meta.sharded_mirror)."""
        for table, members in zip(self.groups, self.members):
            slots = table.slots_where(picked)
            for node_id in list(members.values()):
                self._clear(node_id, slots)

    def _clear(self, node_id: str, slots: np.ndarray) -> None:
        """The node no longer holds the blocks at distinct `slots` of its group's table, in any tier."""
        table, mask = self._slot(node_id)
        counts = self.counts[node_id]
        for tier in [t for t, num in counts.items() if num]:
            counts[tier] -= table.clear_bits(slots, tier, mask)
        if not any(counts.values()):
            self._release(node_id)

    def remove_node(self, node_id: str) -> None:
        if node_id not in self.slot_of:
            return
        table, mask = self._slot(node_id)
        for tier, num in self.counts[node_id].items():
            if num:
                table.clear_column(tier, mask)
        self._release(node_id)

    def tier_of(self, node_id: str, key: BlockKey) -> str | None:
        if node_id not in self.slot_of:
            return None
        table, mask = self._slot(node_id)
        slot = int(table.find(fingerprints([key]))[0])
        if slot == ABSENT:
            return None
        return next((tier for tier, num in self.counts[node_id].items() if num and table.columns[tier][slot] & mask),
                    None)

    def holders_of(self, key: BlockKey) -> dict[str, str]:
        """{node: tier} of every holder of `key` (tests and /debug; the router asks longest_prefix)."""
        return {node_id: tier for node_id in self.slot_of if (tier := self.tier_of(node_id, key)) is not None}

    def lower_tiers(self, node_id: str, keys: Iterable[BlockKey]) -> dict[str, int]:
        """{tier: count} of `keys` that `node_id` holds below the device; {} at once when it holds none there."""
        lower = [t for t, num in self.counts.get(node_id, {}).items() if num and t != DEVICE]
        if not lower:
            return {}
        table, mask = self._slot(node_id)
        slots = table.find(fingerprints(list(keys)))
        slots = slots[slots != ABSENT]
        found = {tier: int(np.count_nonzero(table.columns[tier][slots] & mask)) for tier in lower}
        return {tier: num for tier, num in found.items() if num}

    def longest_prefix(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """Per node, how many keys from keys[0] on it holds consecutively (nodes with 0 omitted)."""
        if not keys:
            return {}
        fps, matches = fingerprints(keys), {}
        for table, members in zip(self.groups, self.members):
            if members:
                run = np.bitwise_and.accumulate(table.bits(fps))
                first = int(run[0])
                for bit, node_id in members.items():
                    if first >> bit & 1:
                        matches[node_id] = int(np.count_nonzero(run & np.uint64(1 << bit)))
        return matches

    def last_held(self, keys: Sequence[BlockKey], spans: Sequence[tuple[int, int]]) -> list[dict[str, int]]:
        """Per (start, stop) span of `keys`: per node, 1 + the position of the last key in the span that it holds,
        whatever it holds before (nodes holding none there omitted). Every span in one lookup: the partial runs
        a node's chain tails reach into (prefixpool.meta.runs)."""
        found: list[dict[str, int]] = [{} for _ in spans]
        picked = [keys[i] for start, stop in spans for i in range(start, stop)]
        if not picked:
            return found
        fps = fingerprints(picked)
        for table, members in zip(self.groups, self.members):
            if members:
                words, offset = table.bits(fps).tolist(), 0
                for answer, (start, stop) in zip(found, spans):
                    _last_bits(words[offset : offset + stop - start], start, members, answer)
                    offset += stop - start
        return found

    def _slot(self, node_id: str) -> tuple[BlockTable, np.uint64]:
        """The node's group table and bit, given one on first use (the lowest free)."""
        if node_id not in self.slot_of:
            group = next((g for g, m in enumerate(self.members) if len(m) < self.group_nodes), len(self.groups))
            if group == len(self.groups):
                self.groups.append(BlockTable())
                self.members.append({})
            bit = next(b for b in range(self.group_nodes) if b not in self.members[group])
            self.members[group][bit] = node_id
            self.slot_of[node_id], self.counts[node_id] = (group, bit), {}
        group, bit = self.slot_of[node_id]
        return self.groups[group], np.uint64(1 << bit)

    def _release(self, node_id: str) -> None:
        """Forget a node that holds nothing: its bit is free for the next node."""
        group, bit = self.slot_of.pop(node_id)
        del self.members[group][bit], self.counts[node_id]

    def check_integrity(self) -> None:
        for group, (table, members) in enumerate(zip(self.groups, self.members)):
            table.check_integrity()
            everyone = np.uint64(sum(1 << bit for bit in members))
            for tier, column in table.columns.items():
                assert not (column & ~everyone).any(), f"group {group} {tier}: bits of no node"
            for bit, node_id in members.items():
                assert self.slot_of[node_id] == (group, bit), node_id
                self._check_node(table, node_id, np.uint64(1 << bit))
        assert len(self.slot_of) == len(self.counts) == sum(map(len, self.members))

    def _check_node(self, table: BlockTable, node_id: str, mask: np.uint64) -> None:
        held = [(table.columns[tier] & mask) != 0 for tier in table.columns]
        assert not held or max(np.sum(held, axis=0)) <= 1, f"{node_id} holds a block in two tiers"
        for tier, column in table.columns.items():
            num = int(np.count_nonzero(column & mask))
            assert self.counts[node_id].get(tier, 0) == num, (node_id, tier, self.counts[node_id], num)
        assert self.num_blocks(node_id) > 0, f"{node_id} holds nothing but keeps its bit"


def _distinct(fps: np.ndarray) -> np.ndarray:
    return np.unique(fps) if fps.size > 1 else fps  # np.unique costs more than the rest of a one-key add


def _last_bits(words: list[int], start: int, members: dict[int, str], answer: dict[str, int]) -> None:
    """Into `answer`: each member's 1 + position (from `start`) of the last word with its bit set."""
    seen = 0
    for at in range(len(words) - 1, -1, -1):
        new = words[at] & ~seen
        if new:
            seen |= new
            for bit, node_id in members.items():
                if new >> bit & 1:
                    answer[node_id] = start + at + 1
