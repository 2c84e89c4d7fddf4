"""The `pressure` policy: the cost policy, priced for full caches, aware of what it just routed, tail bounded.

    matches  = max(index, speculative entries)    blocks routed to a node and not yet in its KV events count
                                                  as held there (prefixpool.router.speculative)
    per worker, the cost policy's terms (queue + prefill + fetch + lost reuse), and
        stored   = prompt blocks it would compute and keep   (all but its reused prefix)
        free     = its free blocks - its speculative blocks   (NodeLoad.free_blocks; None: unknown, never priced)
        evict_s  = lost-reuse weight x prefill of max(0, stored - free) blocks
    best     = the cheapest
    tail     = best.ttft_s > max_ttft_ratio x the fastest one's ttft_s + max_ttft_gap_s  ─▶  the fastest
               best's requests in flight > 2 x the fewest + max_request_gap             ─▶  the least busy
    record     best.worker holds the prompt's blocks, speculatively, for ttl_s

Why each part. A second copy of a prefix on a node whose cache is full pushes other blocks out, and
those are recomputed later: priced, the copy happens only when the holder's queue outweighs a full
prefill plus that recompute, i.e. when the prefix's load needs two nodes. A burst of a new prefix
arrives faster than vLLM's KV events come back; counted as held where it went, the burst stays on one
node. And no holder's queue grows without limit while another node idles: the prices (lost reuse,
eviction) never keep a request on a node whose predicted TTFT is more than twice another's plus 2 s
(what a prefix is worth buys at most that much TTFT), and they spill only where that is faster, so a
spill never recomputes its way into a longer queue. A bound relative to the request's own TTFT, not
a fixed gap: with a 70B model's multi-second prefills a 2 s gap alone spilled held prefixes to be
recomputed (`prefixpool replay synthetic --no-fetch`: hit rate 0.323 against the ratio's 0.352).
The second tail rule counts requests, not predicted seconds: where a request's cost is mostly fixed
(vLLM on a CPU, a tiny model), a hit's few prefill tokens hide a queue that grows to tens of seconds
(measured: benchmarks/gateway.md). Knows nothing of HTTP, etcd or the engine.
"""

from __future__ import annotations

import random
import time
from typing import Callable

from prefixpool.router.cost_model import CostModel
from prefixpool.router.policy import NodeLoad, Plan, RouteRequest, Shared, Terms, plan_of, terms_for
from prefixpool.router.speculative import SpeculativeBlocks


class Pressure:
    """Stateful (its speculative entries): one instance per router, or per simulated run."""

    def __init__(self, ttl_s: float = 5.0, max_ttft_ratio: float = 2.0, max_ttft_gap_s: float = 2.0,
                 max_request_gap: int = 4, clock: Callable[[], float] = time.monotonic) -> None:
        self.speculative = SpeculativeBlocks(ttl_s)
        self.max_ttft_ratio, self.max_ttft_gap_s = max_ttft_ratio, max_ttft_gap_s
        self.max_request_gap = max_request_gap
        self.clock = clock

    def __call__(self, request: RouteRequest, matches: dict[str, int], loads: dict[str, NodeLoad],
                 costs: CostModel, rng: random.Random, *, explain: bool = False) -> Plan:
        now = self.clock()
        self.speculative.expire(now)
        shared = Shared(request, self.with_speculative(request, matches), costs, allow_fetch=True)
        candidates = tuple(self.priced(terms_for(w, loads[w], shared), loads[w], request, costs)
                           for w in sorted(loads))
        best = min(candidates, key=lambda t: (t.cost_s, -t.local_blocks, t.worker))
        fastest = min(candidates, key=lambda t: (t.ttft_s, t.cost_s, t.worker))
        if best.ttft_s > self.max_ttft_ratio * fastest.ttft_s + self.max_ttft_gap_s:  # only where it is faster
            best = fastest
        least = min(candidates, key=lambda t: (loads[t.worker].num_running, t.ttft_s, t.worker))
        if loads[best.worker].num_running > 2 * loads[least.worker].num_running + self.max_request_gap:
            best = least
        if not explain:  # /v1/route answers where a request would go; it routes nothing
            self.speculative.add(best.worker, request.keys[matches.get(best.worker, 0):], now)
        return plan_of(request, best, candidates if explain else (), costs)

    def with_speculative(self, request: RouteRequest, matches: dict[str, int]) -> dict[str, int]:
        """The index's matches, continued through speculative entries; entries the index now shows go."""
        for node, num in matches.items():
            if self.speculative.num_pending(node):
                self.speculative.confirm(node, request.keys[:num])
        return self.speculative.extend(request.keys, matches)

    def priced(self, terms: Terms, load: NodeLoad, request: RouteRequest, costs: CostModel) -> Terms:
        """`terms` with what storing the request's new blocks on a full node evicts."""
        if load.free_blocks is None:
            return terms
        stored = request.num_blocks - terms.local_blocks - terms.fetch_blocks
        free = load.free_blocks - self.speculative.num_pending(terms.worker)
        evicted = max(0, stored - max(0, free))
        if not evicted:
            return terms
        return terms._replace(evict_s=costs.lost_reuse_weight * costs.prefill_s(evicted * costs.block_size, 0))
