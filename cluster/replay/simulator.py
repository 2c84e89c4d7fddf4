"""Discrete-event simulation of a prefill cluster replaying a trace.

    arrival ─▶ index.longest_prefix(keys) ─▶ policy.choose (the router's own code)
            ─▶ node queue: start = max(node free, arrival + transfer), end = start + prefill
            ─▶ at end: the node's LRU pool stores the request's blocks, the index learns them

Each node has a real store.pool.BlockPool (behind NodeBlocks) as its LRU (with optional modelled
host and SSD tiers under it, cluster/replay/sim_node.py) and the cluster a real
router.index.BlockIndex that records each block's tier; the policies and
cost model are router.policy's. A hit in host or on the SSD costs its read
time (CostModel.tier_read_s) before prefill, on the node that serves it.
Token counts follow the trace's bound: a request hits min(k x block, input)
tokens when its first k block ids are cached. Knows nothing of HTTP or etcd.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cluster.replay.sim_node import SimNode
from cluster.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord, keys_of
from router.cost_model import CostModel
from router.index import BlockIndex
from router.policy import NodeLoad, RouteRequest, policies
from store.keys import BlockKey, Namespace

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
        return config.capacity_blocks
    return len({i for r in records for i in r.hash_ids}) + 1


def simulate(records: list[TraceRecord], policy: str, config: SimConfig) -> SimResult:
    costs, block = config.costs, config.costs.block_size
    capacity = _capacity(config, records)
    nodes = {f"n{i}": SimNode(f"n{i}", capacity, config.host_blocks, config.disk_blocks) for i in range(config.num_nodes)}
    tiered = bool(config.host_blocks or config.disk_blocks)
    index, choose, rng = BlockIndex(), policies()[policy], random.Random(config.seed)
    finishing: list[tuple[float, int, str, list[BlockKey], int]] = []  # (end, seq, node, keys, tokens)
    ttfts, fractions, hit_tokens, moved = [], [], 0, 0

    def finish_until(now: float) -> None:
        while finishing and finishing[0][0] <= now:
            _, _, name, keys, tokens = heapq.heappop(finishing)
            node = nodes[name]
            node.queued_tokens -= tokens
            for key in node.store(keys):
                tier = node.tier_of(key)
                if tier is None:
                    index.remove(name, [key])
                else:
                    index.add(name, [key], tier)

    for seq, record in enumerate(records):
        arrival = record.timestamp_ms / 1000.0
        finish_until(arrival)
        keys = keys_of(record, NAMESPACE)
        matches = index.longest_prefix(keys)
        loads = {n: NodeLoad(queued_prefill_tokens=node.queued_tokens) for n, node in nodes.items()}
        lower = _lower_tiers(nodes, keys, matches) if tiered else {}
        plan = choose(RouteRequest(record.input_length, len(keys), lower), matches, loads, costs, rng)
        node = nodes[plan.worker]
        read_s = sum(costs.tier_read_s(tier, n) for tier, n in lower.get(plan.worker, {}).items())
        reused = min(plan.fetch_end * block, record.input_length)
        computed = max(1, record.input_length - reused)
        transfer_s = costs.transfer_s(plan.fetch_end - plan.fetch_start) if plan.fetch_from else 0.0
        start = max(node.free_at, arrival + transfer_s)
        prefill_s = read_s + costs.prefill_s(computed, reused)
        node.free_at, node.busy_s = start + prefill_s, node.busy_s + prefill_s
        node.queued_tokens += computed
        heapq.heappush(finishing, (node.free_at, seq, plan.worker, keys, computed))
        ttfts.append(node.free_at - arrival)
        fractions.append(reused / record.input_length)
        hit_tokens += reused
        moved += (plan.fetch_end - plan.fetch_start) * costs.block_bytes if plan.fetch_from else 0
    ttft = np.array(ttfts)
    return SimResult(policy, len(records), hit_tokens / sum(r.input_length for r in records), ttft,
                     np.array(fractions), int((ttft > config.slo_s).sum()), moved,
                     np.array([n.busy_s for n in nodes.values()]))


def _lower_tiers(nodes: dict[str, SimNode], keys: Sequence[BlockKey], matches: dict[str, int]) -> dict:
    return {name: lower for name, num in matches.items() if (lower := nodes[name].lower_blocks(keys[:num]))}


def hit_rate_bound(records: list[TraceRecord]) -> float:
    """Block-level prefix hits with an infinite cache, as a fraction of input tokens."""
    seen: set[int] = set()
    hits = 0
    for record in records:
        k = 0
        while k < len(record.hash_ids) and record.hash_ids[k] in seen:
            k += 1
        hits += min(k * TRACE_BLOCK_TOKENS, record.input_length)
        seen.update(record.hash_ids)
    return hits / sum(r.input_length for r in records)
