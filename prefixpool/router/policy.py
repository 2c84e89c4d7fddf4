"""Routing policies: pure functions from (request, matches, loads, costs) to a Plan.

    cost           min over workers of  queue wait + prefill of what it must compute
                                        + transfer of what it can fetch from a peer
                                        + reading its own host/SSD hits up to the device
                                        + weight x prefill of a held prefix it would recompute
    cost_local     the same, never fetching (each node only reuses its own cache)
    pressure       cost, plus what storing the request evicts on a full node, speculative entries for
                   blocks just routed, and a bound on the queue gap (prefixpool.router.pressure)
    least_load     fewest queued prefill tokens, then fewest running
    longest_prefix most locally matched blocks, load ignored (piles up on hot prefixes)
    round_robin    rotate through workers
    random         uniform

`matches` maps node -> blocks it holds consecutively from the first key
(prefixpool.meta.index.BlockIndex.longest_prefix); `loads` has one entry per candidate
worker and defines the candidates. The live router and the trace simulator
call the same functions. What every candidate shares (the fleet's longest
prefix, the two best peers to fetch from) is priced once per decision, and the
per-candidate breakdown (Plan.candidates) is kept only with `explain=True`
(/v1/route): one decision costs O(workers), not O(workers^2).
Knows nothing of HTTP, etcd or the engine.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

from prefixpool.router.cost_model import CostModel
from prefixpool.store.keys import BlockKey


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    num_blocks: int  # full blocks of the prompt (keys)
    # node -> {tier: blocks} of its matched prefix that sit below the device ("host", "disk")
    lower_tier_blocks: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # nodes that can send or receive a block transfer (None: all); vLLM nodes read only their own cache
    transfer_nodes: frozenset[str] | None = None
    keys: Sequence[BlockKey] = ()  # the prompt's block keys: what a policy with speculative entries records


@dataclass(frozen=True)
class NodeLoad:
    queued_prefill_tokens: int = 0
    num_running: int = 0
    free_blocks: int | None = None  # cache blocks holding no indexed block (None: unknown); 0 = full, a store evicts


class Terms(NamedTuple):
    """Predicted TTFT of one candidate, term by term (a tuple: one is built per worker per decision)."""

    worker: str
    local_blocks: int
    fetch_from: str | None
    fetch_blocks: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    tier_read_s: float = 0.0  # host/SSD hits promoted before prefill: between a device hit and a recompute
    lost_reuse_s: float = 0.0  # priced, not waited: recomputing what another node holds (CostModel)
    evict_s: float = 0.0  # priced, not waited: recomputing what storing this request evicts (policy `pressure`)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s + self.tier_read_s

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.lost_reuse_s + self.evict_s


@dataclass(frozen=True)
class Plan:
    worker: str
    fetch_from: str | None
    fetch_start: int
    fetch_end: int
    local_blocks: int
    prefill_tokens: int
    predicted_ttft_s: float
    candidates: tuple[Terms, ...] = field(default=())

    def hit_blocks(self, num_prompt_tokens: int, block_size: int) -> int:
        """Full blocks this plan counts on not recomputing."""
        return min(self.fetch_end, reusable_blocks(num_prompt_tokens, block_size))

    def explain(self) -> dict:
        return {
            "worker": self.worker,
            "fetch": None if self.fetch_from is None else
            {"from": self.fetch_from, "start_block": self.fetch_start, "end_block": self.fetch_end},
            "local_blocks": self.local_blocks,
            "prefill_tokens": self.prefill_tokens,
            "predicted_ttft_s": self.predicted_ttft_s,
            "candidates": [{**t._asdict(), "ttft_s": t.ttft_s, "cost_s": t.cost_s} for t in self.candidates],
        }


def reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most full blocks a prompt can reuse: its last token is always computed, so a prompt ending
    on a block boundary reuses at most one block less than it holds."""
    return max(0, num_prompt_tokens - 1) // block_size


def _cached_tokens(request: RouteRequest, blocks: int, costs: CostModel) -> int:
    # A fully cached prompt still computes its last token (its logits are needed).
    return max(0, min(blocks * costs.block_size, request.num_prompt_tokens - 1))


class Shared:
    """What every candidate of one decision shares, priced once: the fleet's held prefix and the best peers.

    peers: the two longest matches among nodes that can send blocks, longest first (ties: the
    larger name), so the best peer of any worker is the first of them that is not itself.
    """

    __slots__ = ("request", "matches", "costs", "held_s", "peers")

    def __init__(self, request: RouteRequest, matches: dict[str, int], costs: CostModel, allow_fetch: bool) -> None:
        self.request, self.matches, self.costs = request, matches, costs
        self.held_s = _prefill_s(request, max(matches.values(), default=0), costs)  # reusing all the fleet holds
        movable = request.transfer_nodes  # None: every node can send and receive blocks
        self.peers = heapq.nlargest(2, ((b, n) for n, b in matches.items() if movable is None or n in movable)) \
            if allow_fetch else []

    def peer_for(self, worker: str, local: int) -> tuple[int, str | None]:
        """The longest match `worker` could fetch that is longer than its own, else (0, None)."""
        movable = self.request.transfer_nodes
        if movable is not None and worker not in movable:
            return 0, None
        for blocks, node in self.peers:
            if node != worker:
                return (blocks, node) if blocks > local else (0, None)
        return 0, None


def terms_for(worker: str, load: NodeLoad, shared: Shared) -> Terms:
    """Cheapest way for `worker` to serve the request: its own prefix, or that plus a peer's longer one."""
    request, costs = shared.request, shared.costs
    local = shared.matches.get(worker, 0)
    queue_s = costs.queue_s(load.queued_prefill_tokens, load.num_running)
    lower = request.lower_tier_blocks.get(worker)
    read_s = sum(costs.tier_read_s(tier, blocks) for tier, blocks in lower.items()) if lower else 0.0
    prefill_s = _prefill_s(request, local, costs)
    lost_s = costs.lost_reuse_weight * (prefill_s - shared.held_s)
    blocks, peer = shared.peer_for(worker, local)
    if peer is not None:
        fetch_prefill_s, transfer_s = _prefill_s(request, blocks, costs), costs.transfer_s(blocks - local)
        fetch_lost_s = costs.lost_reuse_weight * (fetch_prefill_s - shared.held_s)
        if fetch_prefill_s + transfer_s + fetch_lost_s < prefill_s + lost_s:
            return Terms(worker, local, peer, blocks - local, queue_s, fetch_prefill_s, transfer_s, read_s,
                         fetch_lost_s)
    return Terms(worker, local, None, 0, queue_s, prefill_s, 0.0, read_s, lost_s)


def _prefill_s(request: RouteRequest, blocks: int, costs: CostModel) -> float:
    cached = _cached_tokens(request, blocks, costs)
    return costs.prefill_s(request.num_prompt_tokens - cached, cached)


def plan_of(request: RouteRequest, chosen: Terms, candidates: tuple[Terms, ...], costs: CostModel) -> Plan:
    cached = _cached_tokens(request, chosen.local_blocks + chosen.fetch_blocks, costs)
    return Plan(
        worker=chosen.worker, fetch_from=chosen.fetch_from, fetch_start=chosen.local_blocks,
        fetch_end=chosen.local_blocks + chosen.fetch_blocks, local_blocks=chosen.local_blocks,
        prefill_tokens=request.num_prompt_tokens - cached, predicted_ttft_s=chosen.ttft_s, candidates=candidates,
    )


def _all_terms(request, matches, loads, costs, allow_fetch: bool) -> tuple[Terms, ...]:
    shared = Shared(request, matches, costs, allow_fetch)
    return tuple(terms_for(w, loads[w], shared) for w in sorted(loads))


def _by_cost(allow_fetch: bool):
    def choose(request, matches, loads, costs, rng, *, explain: bool = False) -> Plan:
        candidates = _all_terms(request, matches, loads, costs, allow_fetch)
        best = min(candidates, key=lambda t: (t.cost_s, -t.local_blocks, t.worker))
        return plan_of(request, best, candidates if explain else (), costs)
    return choose


def _by_key(key: Callable[[str, dict[str, int], dict[str, NodeLoad]], tuple]):
    def choose(request, matches, loads, costs, rng, *, explain: bool = False) -> Plan:
        if explain:
            candidates = _all_terms(request, matches, loads, costs, False)
            return plan_of(request, min(candidates, key=lambda t: key(t.worker, matches, loads)), candidates, costs)
        worker = min(loads, key=lambda w: key(w, matches, loads))
        return _plan_for(worker, request, matches, loads, costs)
    return choose


def _plan_for(worker: str, request, matches, loads, costs) -> Plan:
    """The plan of one worker chosen without pricing (no fetch), its terms alone computed."""
    return plan_of(request, terms_for(worker, loads[worker], Shared(request, matches, costs, False)), (), costs)


def _pick(request, matches, loads, costs, explain: bool, index: Callable[[int], int]) -> Plan:
    """The worker at `index(len(loads))` in name order; every candidate's terms only to explain."""
    workers = sorted(loads)
    worker = workers[index(len(workers))]
    if not explain:
        return _plan_for(worker, request, matches, loads, costs)
    candidates = _all_terms(request, matches, loads, costs, False)
    return plan_of(request, candidates[workers.index(worker)], candidates, costs)


def _random(request, matches, loads, costs, rng: random.Random, *, explain: bool = False) -> Plan:
    return _pick(request, matches, loads, costs, explain, lambda n: rng.choice(range(n)))


class RoundRobin:
    """The one stateful policy: its position lives in the instance, not a global."""

    def __init__(self) -> None:
        self.position = 0

    def __call__(self, request, matches, loads, costs, rng, *, explain: bool = False) -> Plan:
        plan = _pick(request, matches, loads, costs, explain, lambda n: self.position % n)
        self.position += 1
        return plan


class Policy(Protocol):
    def __call__(self, request: RouteRequest, matches: dict[str, int], loads: dict[str, NodeLoad], costs: CostModel,
                 rng: random.Random, *, explain: bool = False) -> Plan: ...


def policies(clock: Callable[[], float] = time.monotonic) -> dict[str, Policy]:
    """A fresh set of policies (round_robin and pressure keep per-instance state); `clock` dates pressure's
    speculative entries (the simulator passes its own)."""
    from prefixpool.router.pressure import Pressure  # it builds on this module's terms

    return {
        "cost": _by_cost(allow_fetch=True),
        "cost_local": _by_cost(allow_fetch=False),
        "pressure": Pressure(clock=clock),
        "least_load": _by_key(lambda w, m, loads: (loads[w].queued_prefill_tokens, loads[w].num_running, w)),
        "longest_prefix": _by_key(lambda w, m, loads: (-m.get(w, 0), w)),
        "round_robin": RoundRobin(),
        "random": _random,
    }


POLICY_NAMES = tuple(policies())
