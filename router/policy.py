"""Routing policies: pure functions from (request, matches, loads, costs) to a Plan.

    cost           min over workers of  queue wait + prefill of what it must compute
                                        + transfer of what it can fetch from a peer
                                        + reading its own host/SSD hits up to the device
                                        + weight x prefill of a held prefix it would recompute
    cost_local     the same, never fetching (each node only reuses its own cache)
    least_load     fewest queued prefill tokens, then fewest running
    longest_prefix most locally matched blocks, load ignored (piles up on hot prefixes)
    round_robin    rotate through workers
    random         uniform

`matches` maps node -> blocks it holds consecutively from the first key
(router.index.BlockIndex.longest_prefix); `loads` has one entry per candidate
worker and defines the candidates. The live router and the trace simulator
call the same functions. Knows nothing of HTTP, etcd or the engine.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

from router.cost_model import CostModel


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    num_blocks: int  # full blocks of the prompt (keys)
    # node -> {tier: blocks} of its matched prefix that sit below the device ("host", "disk")
    lower_tier_blocks: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # nodes that can send or receive a block transfer (None: all); vLLM nodes read only their own cache
    transfer_nodes: frozenset[str] | None = None


@dataclass(frozen=True)
class NodeLoad:
    queued_prefill_tokens: int = 0
    num_running: int = 0


@dataclass(frozen=True)
class Terms:
    """Predicted TTFT of one candidate, term by term."""

    worker: str
    local_blocks: int
    fetch_from: str | None
    fetch_blocks: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    tier_read_s: float = 0.0  # host/SSD hits promoted before prefill: between a device hit and a recompute
    lost_reuse_s: float = 0.0  # priced, not waited: recomputing what another node holds (CostModel)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.transfer_s + self.tier_read_s

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.lost_reuse_s


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

    def explain(self) -> dict:
        return {
            "worker": self.worker,
            "fetch": None if self.fetch_from is None else
            {"from": self.fetch_from, "start_block": self.fetch_start, "end_block": self.fetch_end},
            "local_blocks": self.local_blocks,
            "prefill_tokens": self.prefill_tokens,
            "predicted_ttft_s": self.predicted_ttft_s,
            "candidates": [{**asdict(t), "ttft_s": t.ttft_s, "cost_s": t.cost_s} for t in self.candidates],
        }


def _cached_tokens(request: RouteRequest, blocks: int, costs: CostModel) -> int:
    # A fully cached prompt still computes its last token (its logits are needed).
    return max(0, min(blocks * costs.block_size, request.num_prompt_tokens - 1))


def terms_for(worker: str, request: RouteRequest, matches: dict[str, int], loads: dict[str, NodeLoad],
              costs: CostModel, allow_fetch: bool) -> Terms:
    """Cheapest way for `worker` to serve the request: its own prefix, or that plus a peer's longer one.

    Both options are priced as plain floats; only the cheaper one becomes a Terms (this runs
    once per worker per request).
    """
    local = matches.get(worker, 0)
    load = loads[worker]
    queue_s = costs.queue_s(load.queued_prefill_tokens, load.num_running)
    lower = request.lower_tier_blocks.get(worker)
    read_s = sum(costs.tier_read_s(tier, blocks) for tier, blocks in lower.items()) if lower else 0.0
    prefill_s = _prefill_s(request, local, costs)
    held_s = _prefill_s(request, max(matches.values(), default=0), costs)  # reusing all the fleet holds
    lost_s = costs.lost_reuse_weight * (prefill_s - held_s)
    movable = request.transfer_nodes  # None: every node can send and receive blocks
    if allow_fetch and (movable is None or worker in movable):
        blocks, peer = max(((b, n) for n, b in matches.items()
                            if n != worker and b > local and (movable is None or n in movable)), default=(0, None))
        if peer is not None:
            fetch_prefill_s, transfer_s = _prefill_s(request, blocks, costs), costs.transfer_s(blocks - local)
            fetch_lost_s = costs.lost_reuse_weight * (fetch_prefill_s - held_s)
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


def _by_cost(allow_fetch: bool):
    def choose(request, matches, loads, costs, rng) -> Plan:
        candidates = tuple(terms_for(w, request, matches, loads, costs, allow_fetch) for w in sorted(loads))
        best = min(candidates, key=lambda t: (t.cost_s, -t.local_blocks, t.worker))
        return plan_of(request, best, candidates, costs)
    return choose


def _by_key(key: Callable[[str, dict[str, int], dict[str, NodeLoad]], tuple]):
    def choose(request, matches, loads, costs, rng) -> Plan:
        candidates = tuple(terms_for(w, request, matches, loads, costs, False) for w in sorted(loads))
        best = min(candidates, key=lambda t: key(t.worker, matches, loads))
        return plan_of(request, best, candidates, costs)
    return choose


def _random(request, matches, loads, costs, rng: random.Random) -> Plan:
    candidates = tuple(terms_for(w, request, matches, loads, costs, False) for w in sorted(loads))
    return plan_of(request, rng.choice(candidates), candidates, costs)


class RoundRobin:
    """The one stateful policy: its position lives in the instance, not a global."""

    def __init__(self) -> None:
        self.position = 0

    def __call__(self, request, matches, loads, costs, rng) -> Plan:
        candidates = tuple(terms_for(w, request, matches, loads, costs, False) for w in sorted(loads))
        chosen = candidates[self.position % len(candidates)]
        self.position += 1
        return plan_of(request, chosen, candidates, costs)


Policy = Callable[[RouteRequest, dict[str, int], dict[str, NodeLoad], CostModel, random.Random], Plan]


def policies() -> dict[str, Policy]:
    """A fresh set of policies (round_robin keeps per-instance state)."""
    return {
        "cost": _by_cost(allow_fetch=True),
        "cost_local": _by_cost(allow_fetch=False),
        "least_load": _by_key(lambda w, m, l: (l[w].queued_prefill_tokens, l[w].num_running, w)),
        "longest_prefix": _by_key(lambda w, m, l: (-m.get(w, 0), w)),
        "round_robin": RoundRobin(),
        "random": _random,
    }


POLICY_NAMES = tuple(policies())
