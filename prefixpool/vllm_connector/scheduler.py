"""The connector's scheduler side: how much of a prompt the pool can supply, and what to load and save each step.

    get_num_new_matched_tokens(request, local)   keys of the prompt's full blocks (never its last token)
        etcd mirror: longest prefix per node (per run of publish_run_blocks, as the pools publish: meta/runs.py)
        ─▶ this node's pool, else the pool holding the most
        (a handoff from a prefill server counts its pool as holding what it saved, published yet or not)
        ─▶ plan (keys[:n], peer URL or "") and n·block_size − local tokens (0 when n ≤ local)
    update_state_after_alloc                      the plan becomes a load into the request's blocks [local, n)
    reset()                                       vLLM reset the connector's cache: the next step's
                                                  metadata tells the worker to clear the pool
    build_connector_meta(step)                    loads: every planned load, with vLLM block ids
                                                  saves: each scheduled request's full blocks that the
                                                  step completes, [saved, full), with keys chained on
                                                  (none on a decode server: `saves` off)
    handoff(request)                              a prefill server's answer: its pool, full blocks saved

A plan that needs a peer, or blocks on this node's SSD tier, loads in the
background (get_num_new_matched_tokens answers load_async=True: vLLM parks the
request in WAITING_FOR_REMOTE_KVS and runs the others while the pool reads the
network or the disk); one held in this node's host arena loads layer-wise under
the step's forward pass. The lookup itself never blocks vLLM for long: answering
None makes vLLM ask again next step. etcd is only a hint: the worker reports
blocks that did not arrive and vLLM recomputes from the first of them; a request
fetches from a peer once (after a failure it takes its own pool or recomputes). Saving resumes from the computed-token
count after a rollback, so a block that failed to load is saved once it has
been recomputed. Knows nothing of tensors or sockets.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.mirror import MirrorConfig
from prefixpool.meta.sharded_mirror import index_mirror
from prefixpool.vllm_connector.config import POOL_KIND, ConnectorConfig
from prefixpool.vllm_connector.handoff import Handoff
from prefixpool.vllm_connector.loop_thread import LoopThread
from prefixpool.store.keys import BlockKey, Namespace, chain_from, pack_tokens

log = logging.getLogger(__name__)
LOOKUP_WAIT_S = 0.005  # the mirror answers in microseconds when its thread is free


class _StillLooking(Exception):
    """The mirror's thread has not answered yet."""


@dataclass(frozen=True)
class LoadOp:
    request_id: str
    keys: list[BlockKey]  # the planned prefix; vLLM holds keys[:first] already
    first: int
    block_ids: list[int]  # vLLM blocks for keys[first:]
    peer_url: str  # where the blocks this node lacks come from ("" = none)
    background: bool = False  # loaded while vLLM runs other requests (the request waits for it)


@dataclass(frozen=True)
class SaveOp:
    keys: list[BlockKey]
    block_ids: list[int]


@dataclass(frozen=True)
class Plan:
    keys: list[BlockKey]
    peer_url: str
    on_disk: bool = False  # some of this node's own blocks are on its SSD tier (per the index)


@dataclass
class _Tracked:
    namespace: Namespace
    keys: list[BlockKey] = field(default_factory=list)  # chained over the request's full blocks so far
    saved: int = 0  # blocks handed to the worker to save
    num_peer_loads: int = 0  # one per request: a load that failed is recomputed, not fetched again


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, saves: bool = True) -> None:
        self.config, self.namespace, self.saves = config, namespace, saves
        self.block_size = namespace.block_size
        self.node_id = config.pool_node_id()
        self._loop = LoopThread("prefixpool-scheduler")
        self._clients = [EtcdClient(endpoints) for endpoints in config.shard_endpoints()]
        self._mirror = index_mirror(self._clients, Layout(config.cluster),  # every index shard, when sharded
                                    MirrorConfig(run_blocks=config.publish_run_blocks))  # as the pools publish
        self._loop.run(self._mirror.start())
        self._plans: dict[str, tuple[Plan, int]] = {}  # request -> (plan, blocks vLLM computes itself)
        self._loads: dict[str, tuple[Plan, int, bool]] = {}  # ... and whether it loads in the background
        self._lookups: dict[str, tuple[float, concurrent.futures.Future]] = {}  # request -> (started, lookup)
        self._tracked: dict[str, _Tracked] = {}
        self._reset_pending = False  # the worker clears the pool at the start of the next step

    def close(self) -> None:
        self._loop.run(self._mirror.stop())
        for client in self._clients:
            self._loop.run(client.close())
        self._loop.close()

    def num_matched(self, request_id: str, tokens: list[int], salt: str | None, lora: str | None,
                    num_local: int, handoff: Handoff | None = None) -> int | None:  # fmt: skip
        """Tokens beyond `num_local` the pool can supply now (whole blocks; the last prompt token never);
        None while the lookup is still running (vLLM asks again next step). `handoff`: a prefill server's
        pool that saved this prompt's blocks (handoff.py)."""
        tracked = self._track(request_id, salt, lora)
        num_blocks = (len(tokens) - 1) // self.block_size
        keys = chain_from(tracked.namespace.root(), pack_tokens(tokens[: num_blocks * self.block_size]),
                          self.block_size)
        try:
            plan = self._lookup(request_id, keys, tracked.num_peer_loads == 0, handoff) if keys else None
        except _StillLooking:
            return None
        if plan is None or len(plan.keys) * self.block_size <= num_local:
            self._plans.pop(request_id, None)
            return 0
        self._plans[request_id] = (plan, num_local // self.block_size)
        return len(plan.keys) * self.block_size - num_local

    def loads_in_background(self, request_id: str) -> bool:
        """Whether the planned load waits in the background (if allowed): blocks from a peer (the network)
        or from this node's SSD tier (the disk), not from memory."""
        planned = self._plans.get(request_id)
        return self.config.async_load and planned is not None and bool(planned[0].peer_url or planned[0].on_disk)

    def _lookup(self, request_id: str, keys: list[BlockKey], peers: bool, handoff: Handoff | None) -> Plan | None:
        """The plan, read on the mirror's own thread. Waits LOOKUP_WAIT_S for it, then raises _StillLooking
        (vLLM asks again next step) until lookup_timeout_s: past it the request computes without the pool."""
        started, lookup = (self._lookups.get(request_id)
                           or (time.monotonic(), self._loop.submit(self._plan(keys, peers, handoff))))
        try:
            plan = lookup.result(LOOKUP_WAIT_S)
        except concurrent.futures.TimeoutError:
            if time.monotonic() - started < self.config.lookup_timeout_s:
                self._lookups[request_id] = (started, lookup)
                raise _StillLooking from None
            lookup.cancel()
            log.warning("prefix lookup took over %ss: computing the request without the pool",
                        self.config.lookup_timeout_s)
            plan = None
        self._lookups.pop(request_id, None)
        return plan

    async def _plan(self, keys: list[BlockKey], peers_allowed: bool, handoff: Handoff | None = None) -> Plan | None:
        """This node's pool first; a peer's pool only where it holds strictly more (and the request may fetch).
        A handoff's pool holds what its prefill server saved, whether etcd shows it yet or not."""
        matches = self._mirror.longest_prefix(keys)
        if handoff is not None:
            matches[handoff.pool] = max(matches.get(handoff.pool, 0), min(handoff.num_blocks, len(keys)))
        own = matches.get(self.node_id, 0)
        root = self.namespace.root().hex()
        peers = [(num, node_id) for node_id, num in matches.items() if node_id != self.node_id and num > own
                 and (record := self._mirror.nodes.get(node_id)) is not None and record.kind == POOL_KIND
                 and record.namespace == root and record.transfer_url]
        if peers and peers_allowed:
            num, node_id = max(peers)
            return Plan(keys[:num], self._mirror.nodes[node_id].transfer_url)
        return Plan(keys[:own], "", bool(self._mirror.lower_tiers(self.node_id, keys[:own]))) if own else None

    def reset(self) -> None:
        """vLLM's reset of the connector's cache (after a weight update): plans made so far are stale too."""
        self._reset_pending = True
        self._plans.clear()

    def take_reset(self) -> bool:
        """Whether vLLM reset the cache since the last call (the step's metadata carries it once)."""
        reset, self._reset_pending = self._reset_pending, False
        return reset

    def allocated(self, request_id: str, num_external: int) -> None:
        background = self.loads_in_background(request_id)
        planned = self._plans.pop(request_id, None)
        if num_external > 0 and planned is not None:
            self._loads[request_id] = (planned[0], planned[1], background)
            self._tracked[request_id].num_peer_loads += bool(planned[0].peer_url)

    def step(self, scheduled: dict[str, int], requests: dict[str, object],
             block_ids) -> tuple[list[LoadOp], list[SaveOp]]:
        """This step's loads and saves; `scheduled` = tokens per request, `block_ids(request_id)` its vLLM blocks."""
        # a request vLLM schedules in this very step did not go to WAITING_FOR_REMOTE_KVS: load it now
        loads = [LoadOp(rid, plan.keys, first, block_ids(rid)[first: len(plan.keys)], plan.peer_url,
                        background and rid not in scheduled)
                 for rid, (plan, first, background) in self._loads.items()]
        self._loads.clear()
        saves = []
        for request_id, num_tokens in scheduled.items() if self.saves else ():
            request, tracked = requests.get(request_id), self._tracked.get(request_id)
            if request is None or tracked is None:
                continue
            save = self._save_op(tracked, request, num_tokens, block_ids(request_id))
            if save is not None:
                saves.append(save)
        return loads, saves

    def _save_op(self, tracked: _Tracked, request, num_tokens: int, block_ids: list[int]) -> SaveOp | None:
        full = min((request.num_computed_tokens + num_tokens) // self.block_size, len(block_ids))
        tracked.saved = min(tracked.saved, request.num_computed_tokens // self.block_size)  # after a rollback
        if full <= tracked.saved:
            return None
        if full > len(tracked.keys):
            parent = tracked.keys[-1] if tracked.keys else tracked.namespace.root()
            tokens = request.all_token_ids[len(tracked.keys) * self.block_size: full * self.block_size]
            tracked.keys.extend(chain_from(parent, pack_tokens(tokens), self.block_size))
        start, tracked.saved = tracked.saved, full
        return SaveOp(tracked.keys[start:full], block_ids[start:full])

    def handoff(self, request_id: str) -> Handoff | None:
        """What a prefill server tells the decode server of a finished request: this pool, and the full blocks
        handed to it to save (each saved before vLLM finishes the request); None when nothing was saved."""
        tracked = self._tracked.get(request_id)
        if tracked is None or not tracked.saved or not self.saves:
            return None
        return Handoff(self.node_id, tracked.saved)

    def _track(self, request_id: str, salt: str | None, lora: str | None) -> _Tracked:
        if request_id not in self._tracked:
            self._tracked[request_id] = _Tracked(self.namespace.for_request(salt, lora))
        return self._tracked[request_id]

    def finished(self, request_id: str) -> None:
        for table in (self._plans, self._loads, self._tracked, self._lookups):
            table.pop(request_id, None)
