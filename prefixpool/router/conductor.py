"""The conductor: pair a prefill node with a decode node for one request, or serve it in place.

A fleet whose nodes say `role` "prefill" or "decode" (NodeRecord.role) is routed here instead of by
the plain policy. Two kinds of candidate, priced with the same CostModel:

    in place on n        (n a decode or "both" node; any node when no such node is alive)
        ttft  = queue(n) + prefill(n) + transfer(n)          the policy's own Terms (terms_for)
        cost  = ttft + interference(n)
    disaggregated p -> d (p a prefill node, d a decode node, both able to move blocks)
        ttft  = max(queue(p) + prefill(p) + exposed transfer, queue(d)) + tail(d) + handoff setup
                exposed transfer = max(transfer of one block, transfer(moved) - prefill(p)):
                our workers: p publishes each block as it commits it and d fetches it then, so the
                transfer overlaps p's prefill and only what outlasts it is waited for;
                a vLLM pair (both nodes of kind "vllm"): sequential, exposed transfer = transfer(moved):
                p's request runs to completion, then d's is sent and loads every block first
                handoff setup = what the router has seen handoffs of that kind cost beyond their
                priced terms (HandoffCosts: the configured --pd-handoff-setup-s until it has samples)
                tail(d) = prefill of the prompt's last, partial block (never a block of its own) on d
        cost  = ttft + interference(d)

    interference(n) = interference_weight x compute on n x (running(n) + 1)
        compute on a node that decodes stalls its decode batch (the running requests, and the
        decode this request itself reserves it for): priced, not waited, as lost reuse is

A short prompt, or one whose prefix the decode node already holds, computes little on it, so
in place wins; a long uncached prompt costs a decode node more in stalled decodes than the
handoff costs, so it is disaggregated. Every prefill node is priced with its queue, its own cached
prefix and a peer's prefix it may fetch; every decode node with its queue, its free KV blocks and
what it must receive from that prefill node; the cheapest pair wins (on a tie, the one moving
fewer blocks). One decision costs
O(prefill nodes x decode nodes). Knows nothing of HTTP, etcd or the engine; the live router and tests call `conduct`.

    plan = conduct(request, matches, roles, loads, costs)
    plan.worker / plan.fetch_*     the node that streams the answer and its fetch (from the prefill
                                   node when disaggregated): a Plan, as every policy returns
    plan.prefill                   None (served in place) or the prefill node's own Plan
    plan.explain()                 the Plan's fields + "prefill", "decode", "disaggregation"

    handoffs = HandoffCosts(configured_s)      one per router; conduct(..., kinds=, handoffs=) prices with it
    handoffs.observe(kind, seconds)            a completed handoff's cost beyond its priced terms
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, fields
from typing import Mapping, NamedTuple

from prefixpool.router.cost_model import CostModel
from prefixpool.router.fleet import OWN_KIND
from prefixpool.router.policy import NodeLoad, Plan, RouteRequest, Shared, Terms, plan_of, terms_for
from prefixpool.router.vllm_pair import VLLM_KIND

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
IN_PLACE, DISAGGREGATED = "in_place", "disaggregated"


@dataclass(frozen=True)
class ConductorConfig:
    interference_weight: float = 1.0  # seconds of stalled decode per second of compute, per decoding request
    handoff_setup_s: float = 0.005  # a second request to the prefill node, and the decode node's first poll

    def __post_init__(self) -> None:
        if self.interference_weight < 0 or self.handoff_setup_s < 0:
            raise ValueError("conductor weights must be >= 0")


class HandoffCosts:
    """The handoff setup the router has seen, per pair kind (OWN_KIND: our workers, VLLM_KIND: a vLLM pair).

    A sample is what one completed handoff cost beyond its priced terms: for our workers the decode node's
    reported wait (Usage.handoff_s) less the prefill node's own measured queue + prefill (its Usage.ttft_s)
    and the priced exposed transfer; for a vLLM pair
    the prefill request's round trip measured in the router less the predicted queue + prefill (any error
    in the prefill price lands here too). The estimate is the median of the configured value and the last
    `window` samples: one sample moves it halfway, a few fault-stalled handoffs among many do not move it.
    """

    def __init__(self, configured_s: float, window: int = 16) -> None:
        self.configured_s = configured_s
        self._samples: dict[str, deque[float]] = {}
        self._window = window

    def observe(self, kind: str, seconds: float) -> None:
        self._samples.setdefault(kind, deque(maxlen=self._window)).append(max(0.0, seconds))

    def setup_s(self, kind: str) -> float:
        samples = self._samples.get(kind)
        return statistics.median((self.configured_s, *samples)) if samples else self.configured_s

    def explain(self) -> dict:
        return {"configured_setup_s": self.configured_s,
                "learned": {kind: {"setup_s": self.setup_s(kind), "samples": len(samples), "last_s": samples[-1]}
                            for kind, samples in sorted(self._samples.items())}}


def pair_kind(prefill_kind: str | None, decode_kind: str | None) -> str:
    """The kind of handoff between two nodes: a vLLM pair's (sequential) or our workers' (overlapped)."""
    return VLLM_KIND if prefill_kind == VLLM_KIND and decode_kind == VLLM_KIND else OWN_KIND


class PDTerms(NamedTuple):
    """One candidate's predicted seconds, term by term (in place: no prefill node, no tail, no setup)."""

    mode: str  # IN_PLACE or DISAGGREGATED
    prefill: str | None  # the prefill node, None in place
    decode: str  # the node that streams the answer
    queue_s: float  # before the prompt's compute starts (the prefill node's queue when disaggregated)
    prefill_s: float  # the prompt's compute (and host/SSD reads), on the prefill node when disaggregated
    transfer_s: float  # blocks moved to the streaming node (prefill -> decode, or a peer's prefix in place)
    exposed_transfer_s: float  # of that, what is waited for (the rest overlaps the prefill)
    moved_blocks: int
    decode_queue_s: float = 0.0  # the decode node's queue, waited in parallel with the prefill
    tail_s: float = 0.0  # the decode node computes the partial last block (and the last token)
    setup_s: float = 0.0
    interference_s: float = 0.0  # priced, not waited: decode steps stalled by compute on a decoding node
    lost_reuse_s: float = 0.0  # priced, not waited: a held prefix recomputed (the policy's Terms.lost_reuse_s)
    handoff_kind: str = ""  # disaggregated: the pair's kind (pair_kind), whose setup_s was priced
    sequential: bool = False  # a vLLM pair: the whole transfer is waited, after the prefill

    @property
    def ttft_s(self) -> float:
        ready = self.queue_s + self.prefill_s + self.exposed_transfer_s
        return max(ready, self.decode_queue_s) + self.tail_s + self.setup_s

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.interference_s + self.lost_reuse_s


@dataclass(frozen=True)
class PDPlan(Plan):
    """A Plan for the node that streams the answer, with the prefill leg (None: served in place)."""

    prefill: Plan | None = None
    terms: PDTerms | None = None
    alternatives: tuple[PDTerms, ...] = ()  # with explain: the best candidate of each kind
    reason: str = ""
    handoff: dict | None = None  # with explain: HandoffCosts.explain() (None: configured setup only)

    @property
    def decode(self) -> str:
        return self.worker

    def explain(self) -> dict:
        terms = self.terms
        leg = None if self.prefill is None else {"node": self.prefill.worker, **_leg(self.prefill)}
        return {**super().explain(), "prefill": leg,
                "decode": {"node": self.worker, **_leg(self), "moved_blocks": terms.moved_blocks if terms else 0},
                "disaggregation": {
                    "mode": terms.mode if terms else IN_PLACE, "why": self.reason,
                    "terms": _terms_dict(terms) if terms else None, "handoff": self.handoff,
                    "alternatives": [_terms_dict(t) for t in self.alternatives]}}


def _leg(plan: Plan) -> dict:
    return {"local_blocks": plan.local_blocks, "prefill_tokens": plan.prefill_tokens,
            "fetch": None if plan.fetch_from is None else
            {"from": plan.fetch_from, "start_block": plan.fetch_start, "end_block": plan.fetch_end}}


def _terms_dict(terms: PDTerms) -> dict:
    return {**terms._asdict(), "ttft_s": terms.ttft_s, "cost_s": terms.cost_s}


def is_disaggregated(roles: Mapping[str, str]) -> bool:
    """Whether a fleet needs the conductor: some node says it only prefills or only decodes."""
    return any(role in (PREFILL, DECODE) for role in roles.values())


def conduct(request: RouteRequest, matches: dict[str, int], roles: Mapping[str, str], loads: Mapping[str, NodeLoad],
            costs: CostModel, config: ConductorConfig = ConductorConfig(), *,
            free_blocks: Mapping[str, int | None] | None = None, explain: bool = False,
            kinds: Mapping[str, str] | None = None, handoffs: HandoffCosts | None = None) -> PDPlan:
    """The cheapest way to serve `request` on this fleet (see the module doc). `loads` names the candidates;
    `roles` maps each to "prefill", "decode" or "both" (a node it does not name is "both"); `free_blocks`
    (node -> free KV blocks, None where unknown) keeps decode nodes that cannot hold the request out;
    `kinds` (node -> NodeRecord.kind, our workers where unnamed) makes vLLM pairs sequential; `handoffs`
    prices each pair's setup with what was seen (None: config.handoff_setup_s)."""
    assert loads, "conduct needs at least one candidate"
    shared = Shared(request, matches, costs, allow_fetch=True)
    role = {n: roles.get(n, BOTH) for n in loads}
    in_place = _in_place(request, shared, role, loads, costs, config)
    setup = _Setup(kinds or {}, handoffs, config)
    split = _disaggregated(request, shared, role, loads, costs, config, free_blocks or {}, setup)
    options = [t for t in (in_place, split) if t is not None]
    best = min(options, key=lambda c: (c[0].cost_s, c[0].mode == DISAGGREGATED))
    plan = _plan(request, best, options, costs, explain)
    if explain and handoffs is not None:
        plan = _with_handoff(plan, handoffs.explain())
    return plan


class _Setup(NamedTuple):
    kinds: Mapping[str, str]
    handoffs: HandoffCosts | None
    config: ConductorConfig

    def of(self, prefill: str, decode: str) -> tuple[str, float]:
        kind = pair_kind(self.kinds.get(prefill), self.kinds.get(decode))
        return kind, self.config.handoff_setup_s if self.handoffs is None else self.handoffs.setup_s(kind)


def _with_handoff(plan: PDPlan, handoff: dict) -> PDPlan:
    return PDPlan(**{f.name: getattr(plan, f.name) for f in fields(PDPlan) if f.name != "handoff"}, handoff=handoff)


Candidate = tuple[PDTerms, Terms | None, Terms | None]  # (PD terms, the in-place node's Terms, the prefill node's)


def _in_place(request: RouteRequest, shared: Shared, role: Mapping[str, str], loads: Mapping[str, NodeLoad],
              costs: CostModel, config: ConductorConfig) -> Candidate | None:
    nodes = [n for n in sorted(loads) if role[n] != PREFILL] or sorted(loads)  # prefill nodes only when alone
    best: Candidate | None = None
    for node in nodes:
        terms = terms_for(node, loads[node], shared)
        compute = terms.prefill_s + terms.tier_read_s
        decodes = role[node] != PREFILL
        pd = PDTerms(IN_PLACE, None, node, terms.queue_s, compute, terms.transfer_s, terms.transfer_s,
                     terms.fetch_blocks, interference_s=_interference(config, compute, loads[node]) if decodes else 0.0,
                     lost_reuse_s=terms.lost_reuse_s)
        if best is None or pd.cost_s < best[0].cost_s:
            best = (pd, terms, None)
    return best


def _disaggregated(request: RouteRequest, shared: Shared, role: Mapping[str, str], loads: Mapping[str, NodeLoad],
                   costs: CostModel, config: ConductorConfig, free: Mapping[str, int | None],
                   setup: _Setup) -> Candidate | None:
    movable = request.transfer_nodes
    can_move = [n for n in sorted(loads) if movable is None or n in movable]
    prefills = [n for n in can_move if role[n] == PREFILL]
    decodes = [n for n in can_move if role[n] == DECODE]
    if not prefills or not decodes or request.num_blocks == 0:
        return None
    room = {d: free.get(d, getattr(loads[d], "free_blocks", None)) for d in decodes}  # None: unknown
    roomy = [d for d in decodes if room[d] is None or room[d] > request.num_blocks] or decodes
    best: Candidate | None = None
    for p_terms in (terms_for(p, loads[p], shared) for p in prefills):
        for node in roomy:
            pd = _pair(request, shared, p_terms, node, loads[node], costs, config, *setup.of(p_terms.worker, node))
            if best is None or (pd.cost_s, pd.moved_blocks) < (best[0].cost_s, best[0].moved_blocks):
                best = (pd, None, p_terms)
    return best


def _pair(request: RouteRequest, shared: Shared, p_terms: Terms, node: str, load: NodeLoad, costs: CostModel,
          config: ConductorConfig, kind: str = OWN_KIND, setup_s: float | None = None) -> PDTerms:
    """Prefill on p_terms.worker (its own peer fetch included), hand off to decode node `node`."""
    prefill_s = p_terms.prefill_s + p_terms.tier_read_s + p_terms.transfer_s
    moved = request.num_blocks - min(shared.matches.get(node, 0), request.num_blocks)
    transfer = costs.transfer_s(moved)
    sequential = kind == VLLM_KIND  # the decode request is sent after the prefill's answer: nothing overlaps
    exposed = transfer if sequential else max(costs.transfer_s(min(1, moved)), transfer - prefill_s)
    tail = _tail_s(request, costs)
    return PDTerms(DISAGGREGATED, p_terms.worker, node, p_terms.queue_s, prefill_s, transfer, exposed, moved,
                   costs.queue_s(load.queued_prefill_tokens, load.num_running), tail,
                   config.handoff_setup_s if setup_s is None else setup_s,
                   _interference(config, tail, load), p_terms.lost_reuse_s, kind, sequential)


def _tail_s(request: RouteRequest, costs: CostModel) -> float:
    """The decode node's own compute: the tokens after the last full block (at least the last token)."""
    cached = min(request.num_blocks * costs.block_size, request.num_prompt_tokens - 1)
    return costs.prefill_s(request.num_prompt_tokens - cached, cached)


def _interference(config: ConductorConfig, compute_s: float, load: NodeLoad) -> float:
    return config.interference_weight * compute_s * (load.num_running + 1)


def _plan(request: RouteRequest, best: Candidate, options: list[Candidate], costs: CostModel,
          explain: bool) -> PDPlan:
    pd, terms, p_terms = best
    if terms is not None:
        base = plan_of(request, terms, (), costs)
    else:  # disaggregated: the decode node fetches every full block it lacks and computes the tail only
        local = request.num_blocks - pd.moved_blocks
        tail_tokens = request.num_prompt_tokens - min(request.num_blocks * costs.block_size,
                                                      request.num_prompt_tokens - 1)
        base = Plan(pd.decode, pd.prefill, local, request.num_blocks, local, tail_tokens, pd.ttft_s)
    prefill = None if p_terms is None else plan_of(request, p_terms, (), costs)
    return PDPlan(**{f.name: getattr(base, f.name) for f in fields(Plan)}, prefill=prefill, terms=pd,
                  alternatives=tuple(o[0] for o in options) if explain else (), reason=_why(pd, options))


def _why(chosen: PDTerms, options: list[Candidate]) -> str:
    other = next((o[0] for o in options if o[0].mode != chosen.mode), None)
    if other is None:
        return ("no prefill and decode node can pair (roles, liveness or transfer)" if chosen.mode == IN_PLACE
                else "only disaggregation is possible")
    if chosen.mode == IN_PLACE:
        return (f"in place on {chosen.decode}: cost {chosen.cost_s:.4f}s (compute {chosen.prefill_s:.4f}s) "
                f"<= disaggregated {other.prefill}->{other.decode} {other.cost_s:.4f}s")
    return (f"disaggregated {chosen.prefill}->{chosen.decode}: cost {chosen.cost_s:.4f}s < in place on "
            f"{other.decode} {other.cost_s:.4f}s (compute {other.prefill_s:.4f}s stalls "
            f"{other.interference_s:.4f}s of decoding)")
