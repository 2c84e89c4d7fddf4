"""Discrete-event simulation of a prefill cluster replaying a trace.

    arrival ─▶ index.longest_prefix(keys) ─▶ policy.choose (the router's own code)
            ─▶ node queue: start = max(node free, arrival + transfer), end = start + prefill
            ─▶ at end: the node's LRU pool stores the request's blocks, the index learns them
       (until then the index does not name them: what a burst sees before vLLM's KV events come back;
       the `pressure` policy's speculative entries, dated by the simulated clock, cover that gap)

Each node has a real prefixpool.store.pool.BlockPool (behind NodeBlocks) as its LRU (with optional modelled
host and SSD tiers under it, prefixpool/replay/sim_node.py) and the cluster a real
prefixpool.meta.index.BlockIndex that records each block's tier; the policies and
cost model are prefixpool.router.policy's. A hit in host or on the SSD costs its read
time (CostModel.tier_read_s) before prefill, on the node that serves it.
Token counts follow the trace's bound: a request hits min(k x block, input)
tokens when its first k block ids are cached. Knows nothing of HTTP or etcd.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from prefixpool.replay.sim_node import SimNode
from prefixpool.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord, keys_of
from prefixpool.router.cost_model import CostModel
from prefixpool.meta.index import BlockIndex
from prefixpool.meta import runs
from prefixpool.router.policy import NodeLoad, RouteRequest, policies
from prefixpool.store.keys import BlockKey, Namespace

NAMESPACE = Namespace("mooncake-trace", block_size=TRACE_BLOCK_TOKENS)


@dataclass(frozen=True)
class SimConfig:
    num_nodes: int = 8
    capacity_blocks: int | None = 2000  # per node; None = unlimited
    costs: CostModel = field(default_factory=CostModel)
    slo_s: float = 30.0
    seed: int = 0
    host_blocks: int = 0  # per node, under the device pool; 0 = no host tier
    disk_blocks: int = 0  # per node, local SSD; 0 = no SSD tier
    fetch: bool = True  # nodes send and receive blocks; False: each reuses only its own cache (vLLM servers)
    sub_blocks: int = 1  # split each trace block into this many (32: 16-token blocks); capacity counts trace blocks
    run_blocks: int = 1  # the index learns run boundaries and chain tails (meta.runs); nodes reuse block by block


@dataclass(frozen=True)
class SimResult:
    policy: str
    num_requests: int
    hit_rate: float
    ttft_s: np.ndarray
    hit_fractions: np.ndarray
    slo_violations: int
    bytes_transferred: int
    node_busy_s: np.ndarray

    @property
    def imbalance(self) -> float:
        """Busiest node's prefill seconds over the mean (1.0 = perfectly even)."""
        mean = float(self.node_busy_s.mean())
        return float(self.node_busy_s.max()) / mean if mean else 1.0

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.ttft_s, q))


def _capacity(config: SimConfig, records: list[TraceRecord]) -> int:
    if config.capacity_blocks is not None:
        return config.capacity_blocks * config.sub_blocks
    return (len({i for r in records for i in r.hash_ids}) + 1) * config.sub_blocks


def simulate(records: list[TraceRecord], policy: str, config: SimConfig) -> SimResult:
    capacity = _capacity(config, records)
    nodes = {f"n{i}": SimNode(f"n{i}", capacity, config.host_blocks, config.disk_blocks)
             for i in range(config.num_nodes)}
    clock = _Clock()
    run = _Run(config, nodes, policies(clock)[policy], random.Random(config.seed))
    for seq, record in enumerate(records):
        clock.now = record.timestamp_ms / 1000.0
        run.finish_until(clock.now)
        run.admit(seq, record)
    ttft = np.array(run.ttfts)
    return SimResult(policy, len(records), run.hit_tokens / sum(r.input_length for r in records), ttft,
                     np.array(run.fractions), int((ttft > config.slo_s).sum()), run.moved,
                     np.array([n.busy_s for n in nodes.values()]))


class _Clock:
    """The simulated time, read by the policies that date what they record (pressure's speculative entries)."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Run:
    """One replay's state: the nodes, the cluster index, the prefills in flight, the tallies."""

    config: SimConfig
    nodes: dict[str, SimNode]
    choose: Callable
    rng: random.Random
    index: BlockIndex = field(default_factory=BlockIndex)
    tails: dict[str, set[BlockKey]] = field(default_factory=dict)  # per node, the chain tails the index has
    # (end, seq, node, keys, chain tails, tokens)
    finishing: list[tuple[float, int, str, list[BlockKey], tuple[BlockKey, ...], int]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    fractions: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    moved: int = 0

    def finish_until(self, now: float) -> None:
        """Prefills ended by `now` store their blocks; the index learns each block's tier."""
        while self.finishing and self.finishing[0][0] <= now:
            _, _, name, keys, tails, tokens = heapq.heappop(self.finishing)
            node = self.nodes[name]
            node.queued_tokens -= tokens
            changed = self._published(name, node.store(keys), tails)
            for tier, moved in changed.items():  # one index call per tier, not per key
                if tier is None:
                    self.index.remove(name, moved)
                else:
                    self.index.add(name, moved, tier)

    def _published(self, name: str, touched: list[BlockKey], tails: tuple[BlockKey, ...]) -> dict[str | None, list]:
        """{tier or None: keys} of `touched` that etcd would learn (meta/runs.py, as the node's Publisher does)."""
        known, node, changed = self.tails.setdefault(name, set()), self.nodes[name], {}
        out = runs.published(touched, self.config.run_blocks, tails, known.__contains__)
        for key in out:
            changed.setdefault(node.tier_of(key), []).append(key)
        known.difference_update(changed.get(None, ()))
        if self.config.run_blocks > 1:
            known.update(key for key in tails if key in out and node.tier_of(key) is not None)
        return changed

    def admit(self, seq: int, record: TraceRecord) -> None:
        """Route one arrival with the router's policy and queue its prefill on the chosen node."""
        costs, arrival = self.config.costs, record.timestamp_ms / 1000.0
        keys = keys_of(record, NAMESPACE, self.config.sub_blocks)
        matches = runs.longest_prefix(self.index, keys, self.config.run_blocks)
        loads = {n: NodeLoad(queued_prefill_tokens=node.queued_tokens,
                             free_blocks=node.blocks.num_blocks - node.blocks.pool.num_cached)
                 for n, node in self.nodes.items()}
        lower = _lower_tiers(self.nodes, keys, matches) if self.config.host_blocks or self.config.disk_blocks else {}
        request = RouteRequest(record.input_length, len(keys), lower, None if self.config.fetch else frozenset(), keys)
        plan = self.choose(request, matches, loads, costs, self.rng)
        node = self.nodes[plan.worker]
        read_s = sum(costs.tier_read_s(tier, n) for tier, n in lower.get(plan.worker, {}).items())
        own = _own_prefix(node, keys) if self.config.run_blocks > 1 else plan.fetch_start
        reused = min(max(plan.fetch_end, own) * costs.block_size, record.input_length)
        computed = max(1, record.input_length - reused)
        fetched = max(0, plan.fetch_end - max(plan.fetch_start, own)) if plan.fetch_from else 0
        start = max(node.free_at, arrival + (costs.transfer_s(fetched) if plan.fetch_from else 0.0))
        prefill_s = read_s + costs.prefill_s(computed, reused)
        node.free_at, node.busy_s = start + prefill_s, node.busy_s + prefill_s
        node.queued_tokens += computed
        tails = _tails(record, keys, self.config.sub_blocks)
        heapq.heappush(self.finishing, (node.free_at, seq, plan.worker, keys, tails, computed))
        self.ttfts.append(node.free_at - arrival)
        self.fractions.append(reused / record.input_length)
        self.hit_tokens += reused
        self.moved += fetched * costs.block_bytes


def _tails(record: TraceRecord, keys: list[BlockKey], sub_blocks: int) -> tuple[BlockKey, ...]:
    """The chain tails a node storing `keys` publishes: its last key, and the last of its last full trace block.

    A fleet's node publishes one tail, its chain's last block, and a later turn of the conversation shares the
    whole chain. The trace hashes 512-token blocks: a partial last block gets an id of its own, so here a
    later turn shares the chain only up to its last full trace block, and that block's last key stands in."""
    full = record.input_length // TRACE_BLOCK_TOKENS * sub_blocks
    return tuple(dict.fromkeys(keys[i] for i in (full - 1, len(keys) - 1) if 0 <= i < len(keys)))


def _own_prefix(node: SimNode, keys: Sequence[BlockKey]) -> int:
    """Blocks from keys[0] on the node really holds: its own pool matches block by block, runs or not."""
    held = 0
    while held < len(keys) and node.tier_of(keys[held]) is not None:
        held += 1
    return held


def _lower_tiers(nodes: dict[str, SimNode], keys: Sequence[BlockKey], matches: dict[str, int]) -> dict:
    return {name: lower for name, num in matches.items() if (lower := nodes[name].lower_blocks(keys[:num]))}


def hit_rate_bound(records: list[TraceRecord], num_nodes: int = 1, seed: int = 0,
                   capacity_blocks: int | None = None) -> float:
    """Block-level prefix hits with no timing, as a fraction of input tokens.

    One node with infinite cache: the bound. Several: each request goes to one at random
    (seeded), which is what routing by chance (round robin, in arrival order) gets.
    `capacity_blocks`: each node an LRU of that many blocks, a request's blocks touched tail
    first (as vLLM and prefixpool.store.pool free them), so a chain's head is evicted last."""
    rng = random.Random(seed)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_nodes)]
    hits = 0
    for record in records:
        cache = caches[rng.randrange(num_nodes)]
        k = 0
        while k < len(record.hash_ids) and record.hash_ids[k] in cache:
            k += 1
        hits += min(k * TRACE_BLOCK_TOKENS, record.input_length)
        for hash_id in reversed(record.hash_ids):
            cache[hash_id] = None
            cache.move_to_end(hash_id)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hits / sum(r.input_length for r in records)
